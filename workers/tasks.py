"""The batch task. Idempotent by batch id: a redelivered or superseded batch is skipped.

On the padded path (static, elastic) the task drives the decode loop to the batch's end and
reports each step (``workers.reporting``): text deltas and final answers on the requests' streams,
cancel checks for the rows still running, the log DB, and at the end the batcher's
``CompletionEvent`` (which rows were answered here, the continuations of preempted rows, or, under
split recovery, that the batch outgrew memory). Under continuous execution the task hands the
batch to the engine and returns; the instance's one publisher reports for every group
(``workers.group_publisher``).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from cohort import bus
from cohort.logdb import record_batch
from cohort.protocol import BatchOutcome, CompletionEvent, FailureCode
from cohort.types import Batch
from taskq.celery_app import RUN_BATCH, celery_app
from workers import runtime
from workers.reporting import Reporter, batch_row, complete, mark_admitted
from workers.step_outputs import KVCacheOutOfMemory

if TYPE_CHECKING:  # torch: an upstream worker, which runs these tasks too, never loads it
    from workers.padded_run import PaddedRun

log = logging.getLogger(__name__)


def queue_claim(pipe, batch_id: str, instance: str, visibility_timeout_s: float) -> None:
    """Queue, in ``pipe`` (sync or asyncio), ``instance``'s claim of a batch (``claimed`` reads the
    replies). One round trip (a group per request at low load); a done batch's claim taken here is
    inert: the done marker is read first by every reader of claims, and the claim expires."""
    pipe.exists(bus.done_key(batch_id))
    pipe.set(bus.claim_key(batch_id), instance, nx=True, ex=bus.marker_ttl_s(visibility_timeout_s))
    pipe.get(bus.claim_key(batch_id))


def claimed(replies: list, instance: str) -> bool:
    """True when ``instance`` may run the batch (first claim, or its own earlier claim)."""
    done, _taken, owner = replies[-3:]
    return not done and owner == instance


def claim(rt: runtime.Runtime, batch_id: str) -> bool:
    """True when this instance may run the batch (``queue_claim``)."""
    pipe = rt.redis.pipeline(transaction=False)
    queue_claim(pipe, batch_id, rt.name, rt.settings.visibility_timeout_s)
    return claimed(pipe.execute(), rt.name)


@celery_app.task(name=RUN_BATCH, acks_late=True)
def run_batch_task(batch: dict[str, Any]) -> dict[str, Any]:
    """Run a batch: on the padded path here, to its end; under continuous execution hand it to the
    engine and return, so the solo worker takes the next batch while this one runs. A worker that
    dies then loses the batch the way it loses a running padded batch: the batcher sees its
    heartbeat go and resumes the rows from their streams."""
    return run_batch(runtime.get(), Batch.from_dict(batch))


def run_batch(rt: runtime.Runtime, b: Batch) -> dict[str, Any]:
    """The task's work, whoever delivered the batch (Celery; an upstream-only pool's groups are
    taken on the engine loop's thread: ``upstream.group_intake``): claim it, then run it here or
    hand it to the engine loop."""
    if not claim(rt, b.id):
        log.info("batch %s: already done, cancelled or claimed elsewhere; skipped", b.id)
        return {"batch_id": b.id, "skipped": True}
    if rt.publisher is None:
        return _drive(rt, b, rt.engine.start(b.requests))
    if not rt.publisher.submit(b, [rt.engine.request_prompt_ids(r) for r in b.requests]):
        log.info("batch %s: already running on this instance; this copy is skipped", b.id)
        return {"batch_id": b.id, "skipped": True}
    return {"batch_id": b.id, "running": True}


def _drive(rt: runtime.Runtime, b: Batch, run: PaddedRun) -> dict[str, Any]:
    """Publish the padded batch's steps until it ends, then tell the batcher and record the batch."""
    started = time.time()
    t0 = time.perf_counter()
    rep = Reporter(rt, b, started, cancel=run.cancel)
    base = dict(batch_id=b.id, instance=rt.name, size=b.size, started=started)
    row = batch_row(rt, b, started)
    try:
        mark_admitted(rt, b.id)
        while not run.done:
            out = run.step()
            rep.step(out, run.alive_ids(), run.generated)
    except KVCacheOutOfMemory as e:
        log.warning("batch %s (β=%d, L=%d, G'=%d) ran out of memory: %s", b.id, b.size, b.input_len,
                    b.predicted_gen_len, e)
        finished = time.time()
        complete(rt, CompletionEvent(outcome=BatchOutcome.OOM, error=str(e), finished=finished,
                                     answered=rep.answered, **base))
        record_batch(rt.db, {**row, "finished": finished, "oom": True, "batch_time_s": finished - started})
        return {"batch_id": b.id, "oom": True}
    except Exception as e:  # anything else: fail the batch explicitly, never leave it hanging
        log.exception("batch %s failed", b.id)
        rep.fail_rest(FailureCode.BATCH_FAILED, "the worker failed while running this request's batch")
        complete(rt, CompletionEvent(outcome=BatchOutcome.FAILED, error=f"{type(e).__name__}: {e}",
                                     finished=time.time(), answered=rep.answered,
                                     continuations=rep.continuations, **base))
        return {"batch_id": b.id, "failed": True}
    seconds = time.perf_counter() - t0
    finished = time.time()
    generated = [rep.tokens.get(r.id, 0) for r in b.requests]
    complete(rt, CompletionEvent(outcome=BatchOutcome.DONE, finished=finished, input_len=run.input_len,
                                 gen_len=run.steps, seconds=seconds, generated_tokens=generated,
                                 answered=rep.answered, continuations=rep.continuations,
                                 cancelled=rep.cancelled, **base))
    record_batch(rt.db, {**row, "finished": finished, "actual_gen_len": max(generated, default=0),
                         "batch_time_s": seconds, "oom": False, "peak_mem_bytes": run.peak_kv_bytes})
    if rep.continuations:
        log.info("batch %s: %d row(s) preempted and handed back with their tokens", b.id, len(rep.continuations))
    return {"batch_id": b.id, "seconds": seconds}
