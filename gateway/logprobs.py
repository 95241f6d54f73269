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
