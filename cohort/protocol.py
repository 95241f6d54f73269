"""Typed messages between gateway, batcher and worker; each shape and each code has its owner here.

gateway  → batcher : a ``ProfiledRequest`` (cohort.types) on ``incoming``; a cancelled request id on ``cancels``
batcher  → worker  : a ``Batch`` (cohort.types) as the Celery task argument
worker   → batcher : a ``CompletionEvent`` on ``completions`` (outcome, measurements, continuations)
worker | batcher → gateway : ``StreamEvent``s on the request's Redis Stream (deltas, then one end or error)

Where a gateway streams a row from its upstream engine itself (``ProfiledRequest.owner``), only
metadata crosses: the upstream worker that admitted it sends the owner a ``Release`` (which engine,
what to send it) on the gateway's inbox, and the gateway reports back ``StreamReport``s on the
worker's inbox (progress batched, then the end, a broken stream, a refusal or a cancel).

The JSON forms are what crosses Redis and Celery (JSON only, never pickle). Nothing here imports
torch or redis.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from cohort.types import ProfiledRequest, field_values


def dumps(obj: Any) -> str:
    """Compact JSON: the one encoder for every message."""
    return json.dumps(obj, separators=(",", ":"))


class FailureCode(str, Enum):
    """Why a request failed, and the HTTP status the gateway answers with."""

    OUT_OF_MEMORY = "out_of_memory"   # a single request cannot fit the instance's KV memory
    WORKER_LOST = "worker_lost"       # the instance died too many times running it
    BATCH_FAILED = "batch_failed"     # the worker raised while running the batch
    CANCELLED = "cancelled"           # the client went away; nobody reads the answer
    TIMEOUT = "timeout"               # no answer within the gateway's request timeout
    QUEUE_FULL = "queue_full"         # overload: refused, or shed for a more urgent request

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS[self]

    @classmethod
    def parse(cls, value: str | None) -> FailureCode:
        """A code from a message; anything unknown is a batch failure (500), never a crash."""
        try:
            return cls(value)
        except ValueError:
            return cls.BATCH_FAILED


_HTTP_STATUS = {FailureCode.OUT_OF_MEMORY: 507, FailureCode.WORKER_LOST: 503, FailureCode.BATCH_FAILED: 500,
                FailureCode.CANCELLED: 499, FailureCode.TIMEOUT: 504, FailureCode.QUEUE_FULL: 429}


class FinishReason(str, Enum):
    """Why a row stopped generating (OpenAI's ``finish_reason``)."""

    STOP = "stop"        # EOS, a stop string, or its emulated length
    LENGTH = "length"    # max_tokens reached


class BatchOutcome(str, Enum):
    """How a batch ended, as the worker reports it to the batcher."""

    DONE = "done"        # every row finished, failed or was handed back as a continuation
    OOM = "oom"          # split recovery only: the batch outgrew memory; the batcher splits it
    FAILED = "failed"    # the worker raised; the batcher fails the rows still unanswered


TokenLogprob = list  # [logprob of the chosen token, [[alternative id, logprob], ...] most likely first]
PromptLogprob = list  # a prompt token's: [logprob, [[alternative id, logprob], ...], rank (1 = most likely)]


class ScoredIds(list):
    """Token ids (a plain ``list[int]``) that also carry one ``TokenLogprob`` per id."""

    def __init__(self, ids: list[int] = (), logprobs: list[TokenLogprob] = ()) -> None:
        super().__init__(ids)
        self.logprobs = list(logprobs)


class StreamKind(str, Enum):
    DELTA = "delta"
    END = "end"
    ERROR = "error"


@dataclass
class StreamEvent:
    """One message on a request's stream.

    ``delta``: ``text`` is new text (never a split multi-byte character), ``tokens`` the tokens
    generated so far, ``ids`` their ids and, when asked for, ``logprobs`` (one per id). ``end``: ``text`` is the whole answer, ``tokens`` its length, with
    ``finish_reason``, the batch that finished it and the request's timings. ``error``: ``code``
    (a FailureCode value) and ``message`` written for the client.
    """

    kind: StreamKind
    text: str = ""
    tokens: int = 0
    finish_reason: str | None = None
    code: str | None = None
    message: str | None = None
    batch_id: str | None = None
    batch_size: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    cached_tokens: int = 0  # end: prompt tokens served from the instance's prefix cache
    ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # A request that asked for its prompt's logprobs gets one delta with no text and no ids that
    # carries them: the prompt's ids and one PromptLogprob (None for the first token) per id.
    prompt_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprob | None] = field(default_factory=list)

    @classmethod
    def prompt_scores(cls, tokens: int, ids: list[int], logprobs: list[PromptLogprob | None]) -> StreamEvent:
        """The prompt's logprobs (sent once, from the row's first prefill)."""
        return cls(StreamKind.DELTA, tokens=tokens, prompt_ids=list(ids), prompt_logprobs=list(logprobs))

    @classmethod
    def delta(cls, text: str, tokens: int, ids: list[int] | None = None,
              logprobs: list[TokenLogprob] | None = None) -> StreamEvent:
        """``ids``: the token ids generated since the previous delta (text may be empty while a
        character or a possible stop string is incomplete). A stream's delta ids, in order, are
        the answer's tokens: a batch re-run after a lost worker resumes from them.

        ``logprobs``: one ``TokenLogprob`` per id when the request asked for them."""
        return cls(StreamKind.DELTA, text=text, tokens=tokens, ids=list(ids or []), logprobs=list(logprobs or []))

    @classmethod
    def error(cls, code: FailureCode, message: str) -> StreamEvent:
        return cls(StreamKind.ERROR, code=code.value, message=message)

    @property
    def final(self) -> bool:
        return self.kind is not StreamKind.DELTA

    def to_json(self) -> str:
        d = {k: v for k, v in field_values(self).items() if v not in (None, "", {}, []) or k in ("kind", "tokens")}
        d["kind"] = self.kind.value
        return dumps(d)

    @classmethod
    def from_json(cls, js: str) -> StreamEvent:
        d = json.loads(js)
        d["kind"] = StreamKind(d["kind"])
        return cls(**d)


@dataclass
class CompletionEvent:
    """What the worker tells the batcher when it leaves a batch.

    ``continuations``: rows preempted to make room (elastic execution); the batcher schedules
    them like new requests. ``answered``: ids the worker already finished or failed itself.
    """

    batch_id: str
    outcome: BatchOutcome
    instance: str = ""
    size: int = 0
    started: float = 0.0
    finished: float = 0.0
    error: str | None = None
    input_len: int = 0
    gen_len: int = 0
    seconds: float = 0.0
    generated_tokens: list[int] = field(default_factory=list)
    answered: list[str] = field(default_factory=list)
    continuations: list[ProfiledRequest] = field(default_factory=list)  # their count: the preemptions
    cancelled: int = 0

    def to_json(self) -> str:
        d = field_values(self)
        d["outcome"] = self.outcome.value
        d["continuations"] = [r.to_dict() for r in self.continuations]
        return dumps(d)

    @classmethod
    def from_json(cls, js: str) -> CompletionEvent:
        d = json.loads(js)
        d["outcome"] = BatchOutcome(d["outcome"])
        d["continuations"] = [ProfiledRequest.from_dict(r) for r in d.get("continuations") or []]
        return cls(**d)


@dataclass
class Release:
    """Upstream worker → the owning gateway: run this row on ``url`` now and stream it to its client.

    ``payload`` is the whole completion request the engine gets (prompt — token ids, for a
    continuation the prompt and what was generated —, budget, priority, sampling, ``stream``);
    ``done_tokens`` of the answer were streamed already (a continuation's); ``stop`` the stop strings
    the gateway looks for itself (a server may not apply them); ``limit`` the tokens this run may
    generate (an emulated length ends the answer with "stop", as EOS would)."""

    request_id: str
    instance: str
    url: str
    payload: dict[str, Any]
    done_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    limit: int = 0
    max_tokens: int = 0
    batch_id: str = ""
    batch_size: int = 0
    arrival: float = 0.0     # the request's arrival (wall clock): its timings count from it
    started: float = 0.0     # when its group joined the engine's rows (wall clock)

    def to_json(self) -> str:
        return dumps(field_values(self))

    @classmethod
    def from_json(cls, js: str) -> Release:
        return cls(**json.loads(js))


class ReportKind(str, Enum):
    PROGRESS = "progress"    # tokens streamed since the last report
    FINISH = "finish"        # the answer ended (``finish_reason``)
    BROKEN = "broken"        # the stream broke, went silent or answered 5xx: continue it elsewhere
    REFUSED = "refused"      # the engine answered 4xx: the row fails with its reason
    CANCELLED = "cancelled"  # the client went away: the row is over


@dataclass
class StreamReport:
    """Owning gateway → upstream worker: what a row it streams did. ``ids``: the token ids streamed
    since the previous report of the row (only servers that stream ids have their rows released)."""

    request_id: str
    kind: ReportKind
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    first_token_at: float | None = None
    cached_tokens: int = 0

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in field_values(self).items() if v not in (None, [], 0) or k == "request_id"}
        d["kind"] = self.kind.value
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> StreamReport:
        return cls(**{**d, "kind": ReportKind(d["kind"])})
