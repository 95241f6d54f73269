"""What an upstream server's stream is made of, for whoever reads it (``upstream.sse_client``) and
whoever acts on it (the upstream worker's admission, the gateway's direct streams): one piece of
an answer (``Chunk``, from one SSE ``data:`` object of vLLM's, SGLang's or any OpenAI server's
completion stream) and the two ways a stream fails."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class UpstreamDown(RuntimeError):
    """The server did not answer, broke a stream or answered 5xx: its rows continue elsewhere."""


class UpstreamRefused(RuntimeError):
    """The server answered 4xx to a row's request: the row fails with the server's reason."""


@dataclass
class Chunk:
    """One streamed piece of a row's answer."""

    text: str = ""
    ids: list[int] | None = None          # the server's ids for this piece (token_ids servers)
    finish: str | None = None             # "stop" | "length" on the last piece
    logprobs: list[list] | None = None    # one TokenLogprob per id, when asked and given
    completion_tokens: int | None = None  # usage, when the server sends it
    cached_tokens: int = 0                # usage: prompt tokens its prefix cache had (vLLM, SGLang)


def parse_chunk(data: dict[str, Any]) -> Chunk:
    """One SSE ``data:`` object of a streamed completion as a ``Chunk``."""
    ch = Chunk()
    usage = data.get("usage") or {}
    ch.completion_tokens = usage.get("completion_tokens")
    ch.cached_tokens = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    choices = data.get("choices") or []
    if not choices:
        return ch
    c = choices[0]
    ch.text = c.get("text") or ""
    ch.finish = c.get("finish_reason")
    ids = c.get("token_ids")
    ch.ids = list(ids) if ids is not None else None
    lp = c.get("logprobs")
    if lp and lp.get("token_logprobs") is not None:
        tops = lp.get("top_logprobs") or [None] * len(lp["token_logprobs"])
        ch.logprobs = [[v, [[_token_id(k), w] for k, w in (top or {}).items()]]
                       for v, top in zip(lp["token_logprobs"], tops, strict=False)]
        if ch.ids is None and all(str(t).startswith("token_id:") for t in lp.get("tokens") or ["x"]):
            ch.ids = [_token_id(t) for t in lp["tokens"]]
    return ch


def _token_id(t: str) -> int:
    """vLLM's ``return_tokens_as_token_ids`` form "token_id:123"; -1 for plain text tokens."""
    return int(t.split(":", 1)[1]) if str(t).startswith("token_id:") else -1
