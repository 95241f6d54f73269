"""Completions logprobs in OpenAI's shape: ``tokens`` are pieces of the returned text, so they join
to it, and ``text_offset`` points into it — whatever the chunking, a stop string's cut or an
echoed prompt (property-tested over random token ids of the built-in tokenizer).

Hypothesis (over a second to import) and the tokenizer are loaded by the property test itself,
not when the file is collected: every xdist worker collects every file."""

from __future__ import annotations

import pytest

from cohort.tokenizer import DEFAULT_MODEL, decode, load_tokenizer
from gateway.logprobs import CompletionLogprobs, fit_pieces

ENTRY = [-0.5, []]  # a token's (logprob, alternatives) as the worker sends it


def _render(ids: list[int], text: str, cuts: list[int], offset: int) -> list[dict]:
    """The chunks of one choice: ids and text split at the same proportional points."""
    fmt = CompletionLogprobs(DEFAULT_MODEL, offset=offset)
    bounds = sorted({0, len(ids), *(c % (len(ids) + 1) for c in cuts)})
    out, done_text = [], 0
    for a, b in zip(bounds, bounds[1:], strict=False):
        end = len(text) if b == len(ids) else min(len(text), len(decode(ids[:b])))
        chunk = text[done_text:max(done_text, end)]
        done_text += len(chunk)
        out.append((fmt([(t, ENTRY) for t in ids[a:b]], chunk), chunk))
    return out


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_tokens_join_to_the_text_and_offsets_point_into_it():
    from hypothesis import given, settings
    from hypothesis import strategies as st

    vocab = len(load_tokenizer(DEFAULT_MODEL))

    @settings(max_examples=60, deadline=None)
    @given(ids=st.lists(st.integers(min_value=999, max_value=vocab - 1), min_size=1, max_size=24),
           cuts=st.lists(st.integers(min_value=0, max_value=30), max_size=4),
           stop_cut=st.integers(min_value=0, max_value=6), prefix=st.text(max_size=8))
    def tokens_join_to_the_text_and_offsets_point_into_it(ids, cuts, stop_cut, prefix):
        full = decode(ids)
        text = full[:max(0, len(full) - stop_cut)]  # a stop string cuts the tail off
        chunks = _render(ids, text, cuts, offset=len(prefix))
        tokens = [t for lp, _ in chunks if lp for t in lp["tokens"]]
        offsets = [o for lp, _ in chunks if lp for o in lp["text_offset"]]
        assert "".join(tokens) == text
        assert len(tokens) == len(ids)
        returned = prefix + text
        for token, offset in zip(tokens, offsets, strict=True):
            assert returned[offset:offset + len(token)] == token
        for lp, chunk in chunks:
            assert lp is None or "".join(lp["tokens"]) == chunk

    tokens_join_to_the_text_and_offsets_point_into_it()


def test_pieces_are_text_not_vocabulary_entries():
    tok = load_tokenizer(DEFAULT_MODEL)
    text = "the diagnosis was psychosis, naïve but fine"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    lp = CompletionLogprobs(DEFAULT_MODEL)([(t, ENTRY) for t in ids], decode(ids))
    assert "".join(lp["tokens"]) == decode(ids)
    assert not any(t.startswith("##") for t in lp["tokens"])
    assert lp["text_offset"][0] == 0 and lp["text_offset"][1] == len(lp["tokens"][0])


def test_fit_pieces_gives_the_rest_to_the_last_and_cuts_the_overflow():
    assert fit_pieces(["ab", "c"], "abcd") == ["ab", "cd"]
    assert fit_pieces(["ab", "cd", "ef"], "abc") == ["ab", "c", ""]
