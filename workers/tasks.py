"""The batch task: drives the decode loop and reports each step. Idempotent by batch id: a
redelivered or superseded batch is skipped.

Every step's events go out in one Redis pipeline: text deltas and final answers on the
requests' streams, and the cancel-key checks for the rows still running. A finished request is
recorded in the log DB before its answer is published. When the batch ends the batcher gets a
``CompletionEvent``: which rows were answered here, and the continuations of preempted rows (or,
under split recovery, that the batch outgrew memory).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from cohort import bus
from cohort.logdb import finish_request, record_batch
from cohort.protocol import BatchOutcome, CompletionEvent, FailureCode, ScoredIds, StreamEvent, StreamKind
from cohort.types import Batch, ProfiledRequest
from taskq.celery_app import RUN_BATCH, celery_app
from workers import runtime
from workers.continuous_loop import GroupHandle
from workers.decode import DecodeRun
from workers.decode_outputs import KVCacheOutOfMemory, RowResult, StepOutput

log = logging.getLogger(__name__)
REDIS_OUTAGE_S = 300.0  # how long a running batch waits for Redis before it gives up


def _claim(rt: runtime.Runtime, batch_id: str) -> bool:
    """True when this instance may run the batch (first claim, or its own earlier claim)."""
    r = rt.redis
    if r.exists(bus.done_key(batch_id)):
        return False
    if r.set(bus.claim_key(batch_id), rt.name, nx=True, ex=bus.marker_ttl_s(rt.settings.visibility_timeout_s)):
        return True
    return r.get(bus.claim_key(batch_id)) == rt.name


def _execute(r: redis.Redis, fill: Callable[[Any], None], what: str, limit_s: float = REDIS_OUTAGE_S,
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


def _complete(rt: runtime.Runtime, event: CompletionEvent) -> None:
    def fill(pipe) -> None:
        # the done marker alone answers a redelivery (``_claim`` and the batcher read it first)
        pipe.set(bus.done_key(event.batch_id), event.outcome.value, ex=bus.marker_ttl_s(rt.settings.visibility_timeout_s))
        pipe.delete(bus.claim_key(event.batch_id), bus.admitted_key(event.batch_id))
        pipe.lpush(bus.pool_keys(rt.settings.pool).completions, event.to_json())

    _execute(rt.redis, fill, "the batch's completion")


def _timings(res: RowResult, started: float) -> dict[str, float]:
    """A finished request's timings from its arrival: what its answer and its record both carry."""
    arrival = res.request.arrival
    first = res.first_token_at if res.first_token_at is not None else res.finished_at
    return {"queued_s": max(0.0, started - arrival), "first_token_s": first - arrival,
            "run_s": res.finished_at - started, "total_s": res.finished_at - arrival}


def _end_event(res: RowResult, b: Batch, started: float) -> StreamEvent:
    return StreamEvent(StreamKind.END, text=res.text, tokens=res.tokens, finish_reason=res.finish_reason.value,
                       batch_id=b.id, batch_size=b.size, timings=_timings(res, started))


class _Reporter:
    """Publishes one step's output and remembers what the batcher must hear about."""

    def __init__(self, rt: runtime.Runtime, batch: Batch, started: float) -> None:
        self.rt, self.batch, self.started = rt, batch, started
        self.answered: list[str] = []
        self.continuations: list[ProfiledRequest] = []
        self.tokens: dict[str, int] = {}
        self.cancelled = 0
        self.counted = 0  # of the run's generated tokens, those already added to the metric

    def step(self, out: StepOutput, run: DecodeRun) -> None:
        for res in out.finished:  # the record first: a client that sees the answer finds it
            self._record(res)
        for req, _code, message in out.failed:
            finish_request(self.rt.db, req.id, status="failed", error=message)
        alive = run.alive_ids()
        events = [(req.id, StreamEvent.prompt_scores(req.done_tokens, ids, scores))
                  for req, ids, scores in out.prompt_scores]
        events += [(req.id, StreamEvent.delta(text, n, ids, ids.logprobs if isinstance(ids, ScoredIds) else None))
                  for req, text, n, ids in out.deltas]
        events += [(res.request.id, _end_event(res, self.batch, self.started)) for res in out.finished]
        events += [(req.id, StreamEvent.error(code, message)) for req, code, message in out.failed]

        generated = run.generated - self.counted

        def fill(pipe) -> None:
            for rid, ev in events:
                bus.publish(pipe, rid, ev)
            bus.count_generated(pipe, generated)
            if out.preempted:  # continuous: evicted rows resume on this instance, not via the batcher
                pipe.hincrby(bus.STATS, "preemptions", len(out.preempted))
            if out.swapped:  # of those, the ones whose KV went to the host pool (the rest recompute)
                pipe.hincrby(bus.STATS, "swaps", len(out.swapped))
            for rid in alive:
                pipe.exists(bus.cancel_key(rid))

        replies = _execute(self.rt.redis, fill, "a step's events")
        self.counted = run.generated
        for res in out.finished:
            self.answered.append(res.request.id)
            self.tokens[res.request.id] = res.tokens
        self.answered.extend(req.id for req, _code, _message in out.failed)
        cancelled = [rid for rid, hit in zip(alive, replies[len(replies) - len(alive):], strict=True) if hit]
        if cancelled:
            run.cancel(cancelled)
            self.cancelled += len(cancelled)
            self.answered.extend(cancelled)
            log.info("batch %s: %d cancelled request(s) dropped", self.batch.id, len(cancelled))
        self.continuations.extend(out.evicted)

    def _record(self, res: RowResult) -> None:
        t = _timings(res, self.started)
        finish_request(self.rt.db, res.request.id, status="done", actual_tokens=res.tokens, batch_id=self.batch.id,
                       queued_s=t["queued_s"], run_s=t["run_s"], total_s=t["total_s"], finished=res.finished_at)

    def fail_rest(self, code: FailureCode, message: str) -> None:
        """The batch raised: every row not yet answered gets an explicit error now."""
        handed_back = {c.id for c in self.continuations}
        rest = [r.id for r in self.batch.requests if r.id not in self.answered and r.id not in handed_back]
        for rid in rest:
            finish_request(self.rt.db, rid, status="failed", error=message)

        def fill(pipe) -> None:
            for rid in rest:
                bus.publish(pipe, rid, StreamEvent.error(code, message))

        _execute(self.rt.redis, fill, "failures")
        self.answered.extend(rest)


def _mark_admitted(rt: runtime.Runtime, batch_id: str) -> None:
    """The batch's rows run now: the batcher may send this instance its next one."""
    ttl = bus.marker_ttl_s(rt.settings.visibility_timeout_s)
    _execute(rt.redis, lambda pipe: pipe.set(bus.admitted_key(batch_id), rt.name, ex=ttl), "admission")


def _padded_steps(rt: runtime.Runtime, b: Batch, run: DecodeRun) -> Iterator[StepOutput]:
    _mark_admitted(rt, b.id)
    while not run.done:
        yield run.step()


def _group_steps(rt: runtime.Runtime, b: Batch, handle: GroupHandle, rep: _Reporter) -> Iterator[StepOutput]:
    """The group's outputs as the engine loop produces them; its admission is when it starts."""
    for upd in handle.updates():
        if upd.admitted:
            rep.started = time.time()  # queued until the group joined the running rows
            _mark_admitted(rt, b.id)
        if upd.error is not None:
            raise RuntimeError(f"the continuous engine failed: {upd.error}")
        yield upd.out


@celery_app.task(name=RUN_BATCH, acks_late=True)
def run_batch_task(batch: dict[str, Any]) -> dict[str, Any]:
    """Run a batch: on the padded path here, to its end; under continuous execution hand it to the
    engine loop and return, its rows published by a thread of its own (``_drive``), so the solo
    worker takes the next batch while this one runs. A worker that dies then loses the batch the
    way it loses a running padded batch: the batcher sees its heartbeat go and resumes the rows
    from their streams."""
    rt = runtime.get()
    b = Batch.from_dict(batch)
    if not _claim(rt, b.id):
        log.info("batch %s: already done, cancelled or claimed elsewhere; skipped", b.id)
        return {"batch_id": b.id, "skipped": True}
    if rt.loop is None:
        return _drive(rt, b, rt.engine.start(b.requests))
    handle = rt.loop.submit(b, [rt.engine.request_prompt_ids(r) for r in b.requests])
    threading.Thread(target=_drive, args=(rt, b, handle), name=f"batch-{b.id}", daemon=True).start()
    return {"batch_id": b.id, "running": True}


def _drive(rt: runtime.Runtime, b: Batch, run: DecodeRun | GroupHandle) -> dict[str, Any]:
    """Publish the batch's steps until it ends, then tell the batcher and record the batch."""
    started = time.time()
    t0 = time.perf_counter()
    rep = _Reporter(rt, b, started)
    steps = _padded_steps(rt, b, run) if isinstance(run, DecodeRun) else _group_steps(rt, b, run, rep)
    base = dict(batch_id=b.id, instance=rt.name, size=b.size, started=started)
    batch_row = {"id": b.id, "created": b.created, "started": started, "instance": rt.name,
                 "model": rt.settings.model, "size": b.size, "input_len": b.input_len,
                 "predicted_gen_len": b.predicted_gen_len, "attempt": b.attempt, "splits": b.splits}
    try:
        for out in steps:
            rep.step(out, run)
    except KVCacheOutOfMemory as e:
        log.warning("batch %s (β=%d, L=%d, G'=%d) ran out of memory: %s", b.id, b.size, b.input_len,
                    b.predicted_gen_len, e)
        finished = time.time()
        _complete(rt, CompletionEvent(outcome=BatchOutcome.OOM, error=str(e), finished=finished,
                                      answered=rep.answered, **base))
        record_batch(rt.db, {**batch_row, "finished": finished, "oom": True, "batch_time_s": finished - started})
        return {"batch_id": b.id, "oom": True}
    except Exception as e:  # anything else: fail the batch explicitly, never leave it hanging
        log.exception("batch %s failed", b.id)
        rep.fail_rest(FailureCode.BATCH_FAILED, "the worker failed while running this request's batch")
        _complete(rt, CompletionEvent(outcome=BatchOutcome.FAILED, error=f"{type(e).__name__}: {e}",
                                      finished=time.time(), answered=rep.answered,
                                      continuations=rep.continuations, **base))
        return {"batch_id": b.id, "failed": True}
    if isinstance(run, GroupHandle) and run.duplicate:
        log.info("batch %s: already running on this instance; this copy is skipped", b.id)
        return {"batch_id": b.id, "skipped": True}
    seconds = time.perf_counter() - t0
    finished = time.time()
    generated = [rep.tokens.get(r.id, 0) for r in b.requests]
    padded = isinstance(run, DecodeRun)
    _complete(rt, CompletionEvent(outcome=BatchOutcome.DONE, finished=finished,
                                  input_len=run.input_len if padded else b.input_len,
                                  gen_len=run.steps if padded else max(generated, default=0), seconds=seconds,
                                  generated_tokens=generated, answered=rep.answered,
                                  continuations=rep.continuations, cancelled=rep.cancelled, **base))
    record_batch(rt.db, {**batch_row, "finished": finished, "actual_gen_len": max(generated, default=0),
                         "batch_time_s": seconds, "oom": False, "peak_mem_bytes": run.peak_kv_bytes if padded else None})
    if rep.continuations:
        log.info("batch %s: %d row(s) preempted and handed back with their tokens", b.id, len(rep.continuations))
    return {"batch_id": b.id, "seconds": seconds}
