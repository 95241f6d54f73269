"""What a decode run reports to its caller, step by step: deltas to stream, finished rows,
continuations handed back, failures — plain data, so the Celery task and the tests read it
without knowing the decode loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cohort.protocol import FailureCode, FinishReason, TokenLogprob
from cohort.types import ProfiledRequest


class KVCacheOutOfMemory(RuntimeError):
    """The batch's KV cache outgrew the instance's memory (split recovery: the batcher splits it)."""


@dataclass
class RowResult:
    """A finished row: the whole answer (across earlier preempted runs) and its timings."""

    request: ProfiledRequest
    text: str
    tokens: int
    finish_reason: FinishReason
    first_token_at: float | None
    finished_at: float
    cached_tokens: int = 0   # prompt tokens its KV came from the prefix cache for
    relayed: bool = True     # its answer goes out on its stream (False: its gateway streamed it itself)


@dataclass
class TokenEvent:
    """One row's news from one step, before it is text (``workers.row_text`` renders it)."""

    req: ProfiledRequest
    token: int | None                 # None: the row ended without a new token (EOS, nothing left)
    total_tokens: int                 # generated so far, across earlier runs
    at: float
    first_token_at: float | None
    finish: FinishReason | None = None  # the engine ended the row (EOS, its length)
    scored: TokenLogprob | None = None  # the token's logprobs, when the request asked for them
    piece: str | None = None            # its text as an upstream server rendered it (then not decoded here)
    cached_tokens: int = 0              # with ``finish``: prompt tokens its KV came from the prefix cache for


@dataclass
class StepOutput:
    """What one step produced: text deltas, finished rows, continuations, failures."""

    deltas: list[tuple[ProfiledRequest, str, int, list[int]]] = field(default_factory=list)
    # (request, new text, tokens generated so far, the new token ids: the stream is a checkpoint;
    # ``ScoredIds`` carrying their logprobs when the request asked for them)
    finished: list[RowResult] = field(default_factory=list)
    evicted: list[ProfiledRequest] = field(default_factory=list)
    failed: list[tuple[ProfiledRequest, FailureCode, str]] = field(default_factory=list)
    # (request, its prompt's ids, one PromptLogprob or None per id): rows that asked, at prefill
    prompt_scores: list[tuple[ProfiledRequest, list[int], list]] = field(default_factory=list)
    # continuous execution: rows evicted for pages that wait on the instance and resume there
    preempted: list[str] = field(default_factory=list)
    swapped: list[str] = field(default_factory=list)  # of those, rows whose KV went to the host pool
    # continuous execution: the step's tokens, rendered into deltas and finished rows off the
    # engine thread (``workers.row_text.TextStage.render``)
    tokens: list[TokenEvent] = field(default_factory=list)
