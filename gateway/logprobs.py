"""Logprobs in OpenAI's two shapes, from the (token id, TokenLogprob) pairs the worker sends.

The worker computes them from the distribution each row samples from (after its penalties,
biases, temperature, top-k and top-p: workers.sampling.token_logprob); tokens those ruled out
are reported at −9999 (JSON has no −inf). A token is named by its own decoded text.
"""

from __future__ import annotations

from cohort.tokenizer import token_texts


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


class CompletionLogprobs:
    """``choices[i].logprobs`` of a text completion; ``text_offset`` counts on across the chunks
    of one streamed choice, so this keeps the offset."""

    def __init__(self, model: str, offset: int = 0) -> None:
        self.model, self.offset = model, offset

    def __call__(self, pairs: list[tuple[int, list]]) -> dict:
        names, alts = _named(self.model, pairs)
        offsets = []
        for name in names:
            offsets.append(self.offset)
            self.offset += len(name)
        tops = []
        for name, (_, entry), top in zip(names, pairs, alts, strict=True):
            d = dict(top)
            d.setdefault(name, entry[0])  # as vLLM does: the chosen token is always among them
            tops.append(d)
        return {"tokens": names, "token_logprobs": [entry[0] for _, entry in pairs], "top_logprobs": tops,
                "text_offset": offsets}
