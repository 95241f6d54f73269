"""What a running batch tells the world: its rows' records in the log DB, their events on the
requests' Redis streams, the cancel-key checks for the rows still running, the admission
marker, and the batcher's ``CompletionEvent`` when it ends. One owner of those messages for both
paths: the padded batch task sends one step at a time (``Reporter.step``); under continuous
execution one publisher sends the step of every group on the instance together
(``workers.group_publisher``).

A finished request is recorded in the log DB before its answer is published, so a client that
sees the answer finds the record. Redis writes wait out an outage instead of failing the batch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import redis

from cohort import batcher_hunger, bus, engine_counters
from cohort.logdb import finish_requests
from cohort.protocol import CompletionEvent, FailureCode, ScoredIds, StreamEvent, StreamKind
from cohort.settings import Settings
from cohort.types import Batch, ProfiledRequest
from workers.step_outputs import RowResult, StepOutput


class Outlet(Protocol):
    """What reporting needs of a worker (``workers.runtime.Runtime`` is one): where to write, and
    under which instance name and settings — not the whole runtime, which holds the publisher."""

    settings: Settings
    redis: redis.Redis
    db: Any

    @property
    def name(self) -> str: ...


log = logging.getLogger(__name__)
REDIS_OUTAGE_S = 300.0  # how long a running batch waits for Redis before it gives up
Fill = Callable[[Any], None]  # adds commands to a Redis pipeline


def execute(r: redis.Redis, fill: Fill, what: str, limit_s: float = REDIS_OUTAGE_S,
            first_backoff_s: float = 0.2) -> list:
    """Fill a pipeline and run it, waiting out a Redis outage (restart, failover) instead of
    failing the batch: the rows keep their tokens and their events go out once Redis answers.
    Each attempt builds a new pipeline (a failed one is reset). A retried pipeline may repeat a
    delta; readers skip deltas that do not advance the token count."""
    deadline, backoff = time.monotonic() + limit_s, first_backoff_s
    while True:
        try:
            pipe = r.pipeline(transaction=False)
            fill(pipe)
            return pipe.execute()
        except redis.RedisError as e:
            if time.monotonic() > deadline:
                raise
            log.warning("Redis unavailable while sending %s (%s); retrying in %.1f s", what, e, backoff)
            time.sleep(backoff)
            backoff = min(backoff * 2, 5.0)


def completion_fill(rt: Outlet, event: CompletionEvent) -> Fill:
    """The batch's end: its done marker (which alone answers a redelivery: ``tasks.claim`` and
    the batcher read it first), its claim and admission markers gone, the batcher told."""
    def fill(pipe) -> None:
        pipe.set(bus.done_key(event.batch_id), event.outcome.value, ex=bus.marker_ttl_s(rt.settings.visibility_timeout_s))
        pipe.delete(bus.claim_key(event.batch_id), bus.admitted_key(event.batch_id))
        pipe.lpush(bus.pool_keys(rt.settings.pool).completions, event.to_json())
        batcher_hunger.wake_for_end(pipe, rt.settings.pool, event)
    return fill


def complete(rt: Outlet, event: CompletionEvent) -> None:
    execute(rt.redis, completion_fill(rt, event), "the batch's completion")


def queue_admission_marks(pipe, batch_ids: Sequence[str], settings: Settings, instance: str) -> None:
    """Queue, in ``pipe`` (sync or asyncio), the news that these batches' rows run on ``instance``
    now: the batcher may send it its next one."""
    ttl = bus.marker_ttl_s(settings.visibility_timeout_s)
    for bid in batch_ids:
        pipe.set(bus.admitted_key(bid), instance, ex=ttl)
    batcher_hunger.wake_if_hungry(pipe, settings.pool)


def admitted_fill(rt: Outlet, batch_id: str) -> Fill:
    """The batch's rows run now (``queue_admission_marks``), as a fill of the publisher's pipeline."""
    return lambda pipe: queue_admission_marks(pipe, [batch_id], rt.settings, rt.name)


def mark_admitted(rt: Outlet, batch_id: str) -> None:
    execute(rt.redis, admitted_fill(rt, batch_id), "admission")


def timings(res: RowResult, started: float) -> dict[str, float]:
    """A finished request's timings from its arrival: what its answer and its record both carry."""
    arrival = res.request.arrival
    first = res.first_token_at if res.first_token_at is not None else res.finished_at
    return {"queued_s": max(0.0, started - arrival), "first_token_s": first - arrival,
            "run_s": res.finished_at - started, "total_s": res.finished_at - arrival}


def _end_event(res: RowResult, b: Batch, started: float) -> StreamEvent:
    return StreamEvent(StreamKind.END, text=res.text, tokens=res.tokens, finish_reason=res.finish_reason.value,
                       batch_id=b.id, batch_size=b.size, timings=timings(res, started), cached_tokens=res.cached_tokens)


def batch_row(rt: Outlet, b: Batch, started: float) -> dict[str, Any]:
    """The log DB's row for a batch run, as far as it is known when the batch starts."""
    return {"id": b.id, "created": b.created, "started": started, "instance": rt.name, "model": rt.settings.model,
            "size": b.size, "input_len": b.input_len, "predicted_gen_len": b.predicted_gen_len,
            "attempt": b.attempt, "splits": b.splits}


@dataclass
class Staged:
    """One step of one batch, ready to send: the records to settle first, the pipeline commands,
    and the rows whose cancel keys are checked (their replies come last, in this order)."""

    reporter: Reporter
    out: StepOutput
    records: list[tuple[str, Mapping[str, Any]]]
    fill: Fill
    alive: list[str] = field(default_factory=list)
    generated: int = 0  # tokens generated since the batch's last step (``send`` counts them, once a pipeline)


def send(rt: Outlet, staged: Sequence[Staged], extra: Sequence[Fill] = (), what: str = "a step's events",
         batch_rows: Sequence[Mapping[str, Any]] = ()) -> None:
    """Send steps of one or several batches together: every record (and the ``batch_rows`` of
    batches that end with them) in one log-DB transaction, then one Redis pipeline (the steps'
    events, ``extra`` commands, every cancel check), then each batch learns which of its rows the
    client withdrew (``Reporter.settle``)."""
    finish_requests(rt.db, [rec for s in staged for rec in s.records], batch_rows=batch_rows)
    alive = [rid for s in staged for rid in s.alive]

    def fill(pipe) -> None:
        for s in staged:
            s.fill(pipe)
        for f in extra:
            f(pipe)
        engine_counters.count_generated(pipe, sum(s.generated for s in staged))
        bus.cancelled_flags(pipe, alive)

    replies = execute(rt.redis, fill, what)
    flags = bus.read_cancelled(replies[-1]) if alive else []
    at = 0
    for s in staged:
        s.reporter.settle(s, flags[at:at + len(s.alive)])
        at += len(s.alive)


def _answered_by(out: StepOutput, answered: list[str], tokens: dict[str, int],
                 continuations: list[ProfiledRequest]) -> None:
    """What a step answered (its finished rows with their tokens, its failed ones) and handed back."""
    for res in out.finished:
        answered.append(res.request.id)
        tokens[res.request.id] = res.tokens
    answered.extend(req.id for req, _code, _message in out.failed)
    continuations.extend(out.evicted)


class Reporter:
    """One batch's reporting state: what the batcher must hear about when it ends."""

    def __init__(self, rt: Outlet, batch: Batch, started: float,
                 cancel: Callable[[list[str]], None] | None = None) -> None:
        self.rt, self.batch, self.started, self.cancel = rt, batch, started, cancel
        self.answered: list[str] = []
        self.continuations: list[ProfiledRequest] = []
        self.tokens: dict[str, int] = {}
        self.cancelled = 0
        self.counted = 0  # of the run's generated tokens, those already added to the metric
        self.renewed: dict[str, float] = {}  # when each row's stream expiry was last set (monotonic)

    def stage(self, out: StepOutput, alive: list[str], generated: int) -> Staged:
        """A step's output as records and commands (``send`` sends them). ``generated``: the run's
        generated tokens so far (the metric gets the difference)."""
        records: list[tuple[str, Mapping[str, Any]]] = [(res.request.id, self._record(res)) for res in out.finished]
        records += [(req.id, {"status": "failed", "error": message}) for req, _code, message in out.failed]
        events = [(req.id, StreamEvent.prompt_scores(req.done_tokens, ids, scores))
                  for req, ids, scores in out.prompt_scores]
        events += [(req.id, StreamEvent.delta(text, n, ids, ids.logprobs if isinstance(ids, ScoredIds) else None))
                   for req, text, n, ids in out.deltas]
        events += [(res.request.id, _end_event(res, self.batch, self.started)) for res in out.finished if res.relayed]
        events += [(req.id, StreamEvent.error(code, message)) for req, code, message in out.failed]
        count, self.counted = generated - self.counted, generated
        now = time.monotonic()
        renew = {rid for rid, _ev in events if now - self.renewed.get(rid, -bus.STREAM_RENEW_S) >= bus.STREAM_RENEW_S}
        self.renewed.update(dict.fromkeys(renew, now))

        def fill(pipe) -> None:
            for rid, ev in events:
                bus.publish(pipe, rid, ev, renew=rid in renew)
            if out.preempted:  # continuous: evicted rows resume on this instance, not via the batcher
                pipe.hincrby(bus.STATS, "preemptions", len(out.preempted))
            if out.swapped:  # of those, the ones whose KV went to the host pool (the rest recompute)
                pipe.hincrby(bus.STATS, "swaps", len(out.swapped))

        return Staged(self, out, records, fill, alive, generated=count)

    def settle(self, staged: Staged, cancelled_flags: list[bool]) -> None:
        """After the step went out: remember what was answered, and drop the rows whose clients
        left (their cancel key was set)."""
        out = staged.out
        _answered_by(out, self.answered, self.tokens, self.continuations)
        cancelled = [rid for rid, hit in zip(staged.alive, cancelled_flags, strict=True) if hit]
        if cancelled:
            if self.cancel is not None:
                self.cancel(cancelled)
            self.cancelled += len(cancelled)
            self.answered.extend(cancelled)
            log.info("batch %s: %d cancelled request(s) dropped", self.batch.id, len(cancelled))

    def ended(self, staged: Sequence[Staged]) -> tuple[list[str], dict[str, int], list[ProfiledRequest]]:
        """What the batch will have answered (its rows' tokens) and handed back once its last steps,
        ``staged``, are settled: its completion goes out with them. Nothing is left to cancel then."""
        answered, tokens, back = list(self.answered), dict(self.tokens), list(self.continuations)
        for s in staged:
            _answered_by(s.out, answered, tokens, back)
        return answered, tokens, back

    def step(self, out: StepOutput, alive: list[str], generated: int) -> None:
        """Send one step of this batch alone (the padded path)."""
        send(self.rt, [self.stage(out, alive, generated)])

    def _record(self, res: RowResult) -> dict[str, Any]:
        t = timings(res, self.started)
        return {"status": "done", "actual_tokens": res.tokens, "cached_tokens": res.cached_tokens,
                "batch_id": self.batch.id, "queued_s": t["queued_s"],
                "run_s": t["run_s"], "total_s": t["total_s"], "finished": res.finished_at}

    def fail_rest(self, code: FailureCode, message: str) -> None:
        """The batch raised: every row not yet answered gets an explicit error now."""
        handed_back = {c.id for c in self.continuations}
        rest = [r.id for r in self.batch.requests if r.id not in self.answered and r.id not in handed_back]
        finish_requests(self.rt.db, [(rid, {"status": "failed", "error": message}) for rid in rest])

        def fill(pipe) -> None:
            for rid in rest:
                bus.publish(pipe, rid, StreamEvent.error(code, message))

        execute(self.rt.redis, fill, "failures")
        self.answered.extend(rest)
