"""Logprobs in OpenAI's two shapes, from the (token id, TokenLogprob) pairs the worker sends.

The worker computes them from the distribution each row samples from (after its penalties,
biases, temperature, top-k and top-p: workers.sampling.token_logprob); tokens those ruled out
are reported at −9999 (JSON has no −inf). In chat's shape a token is named by its own decoded
text; in the completions shape ``tokens`` are the pieces of the returned text each token stands
for, so ``"".join(tokens)`` is the text and ``text_offset`` points into it (see ``TextPieces``).
"""

from __future__ import annotations

from cohort.tokenizer import load_tokenizer, token_texts

PARTIAL = "\ufffd"  # what a decoder shows for the first bytes of a character not yet complete


def _named(model: str, pairs: list[tuple[int, list]]) -> tuple[list[str], list[list[tuple[str, float]]]]:
    ids = [tok for tok, _ in pairs]
    alt_ids = [[a for a, _ in entry[1]] for _, entry in pairs]
    flat = token_texts(ids + [a for alts in alt_ids for a in alts], model)
    names, rest = flat[:len(ids)], iter(flat[len(ids):])
    alts = [[(next(rest), lp) for _, lp in entry[1]] for _, entry in pairs]
    return names, alts


def chat(model: str, pairs: list[tuple[int, list]]) -> dict:
    """``choices[i].logprobs`` of a chat completion (or of one streamed chunk)."""
    names, alts = _named(model, pairs)

    def item(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**item(name, entry[0]), "top_logprobs": [item(t, lp) for t, lp in top]}
                        for name, (_, entry), top in zip(names, pairs, alts, strict=True)],
            "refusal": None}


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class TextPieces:
    """The text each token of one answer adds, in order: a token is decoded after a few tokens of
    context (tokenizers put spaces and merge word pieces by context), and a token that ends inside
    a multi-byte character adds nothing until the token that completes it."""

    CONTEXT = 6

    def __init__(self, model: str) -> None:
        self.tokenizer = load_tokenizer(model)
        self.ids: list[int] = []

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True).rstrip(PARTIAL)

    def push(self, token: int) -> str:
        context = self.ids[-self.CONTEXT:]
        before, after = self._decode(context), self._decode(context + [token])
        self.ids.append(token)
        return after[_common_prefix(before, after):]


def fit_pieces(pieces: list[str], text: str) -> list[str]:
    """Pieces that join to exactly ``text`` (what the client was sent): each is cut to what is
    left of the text, and the last takes any rest — a stop string's cut, or a decoder that cleans
    spaces up differently in context, never makes them disagree."""
    out, pos = [], 0
    for piece in pieces:
        out.append(text[pos:pos + len(piece)])
        pos += len(out[-1])
    if out and pos < len(text):
        out[-1] += text[pos:]
    return out


class CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion. Called with each chunk of one choice in
    order (the whole answer when not streamed): ``text_offset`` counts on from ``offset`` (the
    echoed prompt's length) across the chunks, and each chunk's ``tokens`` join to its text."""

    def __init__(self, model: str, offset: int = 0) -> None:
        self.model, self.offset = model, offset
        self.pieces = TextPieces(model)

    def __call__(self, pairs: list[tuple[int, list]], text: str) -> dict | None:
        pieces = fit_pieces([self.pieces.push(tok) for tok, _ in pairs], text)
        offsets = []
        for piece in pieces:
            offsets.append(self.offset)
            self.offset += len(piece)
        self.offset += len(text) - sum(len(p) for p in pieces)  # a chunk's text with no tokens
        if not pairs:
            return None
        _, alts = _named(self.model, pairs)
        tops = []
        for piece, (_, entry), top in zip(pieces, pairs, alts, strict=True):
            d = dict(top)
            d.setdefault(piece, entry[0])  # as vLLM does: the chosen token is always among them
            tops.append(d)
        return {"tokens": pieces, "token_logprobs": [entry[0] for _, entry in pairs], "top_logprobs": tops,
                "text_offset": offsets}


def _prompt_pairs(ids: list[int], entries: list) -> list[tuple[int, list]]:
    return [(tok, e) for tok, e in zip(ids, entries, strict=False) if e is not None]


def echoed_prompt(model: str, ids: list[int], entries: list, text: str) -> dict:
    """The prompt's part of a completion's ``logprobs`` under ``echo`` (OpenAI's legacy shape, what
    lm-eval's log-likelihood reads): its pieces join to the echoed ``text``, offsets from 0, and
    the first token, which has no context, has null logprob and alternatives."""
    splitter = TextPieces(model)
    pieces = fit_pieces([splitter.push(tok) for tok in ids], text)
    offsets, at = [], 0
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    _, alts = _named(model, _prompt_pairs(ids, entries))
    named = iter(alts)
    tops: list[dict | None] = []
    for piece, entry in zip(pieces, entries, strict=False):
        if entry is None:
            tops.append(None)
            continue
        d = dict(next(named))
        d.setdefault(piece, entry[0])
        tops.append(d)
    return {"tokens": pieces, "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": tops, "text_offset": offsets}


def joined(prompt: dict, generated: dict | None) -> dict:
    """An echoed prompt's logprobs followed by the generated tokens' (None: none generated)."""
    if generated is None:
        return prompt
    return {key: prompt[key] + generated[key] for key in prompt}


def vllm_prompt_logprobs(model: str, ids: list[int], entries: list) -> list[dict | None]:
    """vLLM's ``prompt_logprobs``: per prompt token, None for the first, else {token id: {logprob,
    rank, decoded_token}} for the prompt token and its most likely alternatives."""
    pairs = _prompt_pairs(ids, entries)
    names, alts = _named(model, pairs)
    alt_ids = iter([[a for a, _ in entry[1]] for _, entry in pairs])
    by_pair = iter(zip(names, alts, alt_ids, strict=True))
    out: list[dict | None] = []
    for tok, entry in zip(ids, entries, strict=False):
        if entry is None:
            out.append(None)
            continue
        name, named_alts, ids_alt = next(by_pair)
        d = {str(tok): {"logprob": entry[0], "rank": entry[2], "decoded_token": name}}
        for rank, (alt_id, (alt_name, lp)) in enumerate(zip(ids_alt, named_alts, strict=True), 1):
            d.setdefault(str(alt_id), {"logprob": lp, "rank": rank, "decoded_token": alt_name})
        out.append(d)
    return out
