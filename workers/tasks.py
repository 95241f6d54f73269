"""The batch task. Idempotent by batch id: a redelivered or superseded batch is skipped.

Outcomes go back explicitly: every request gets an answer or an error on its result key, and
the batcher gets a completion event (done / oom / failed) so it can free the instance, split an
OOM batch, or fail its requests.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from cohort import bus
from cohort.logdb import finish_request, record_batch
from cohort.types import Batch
from workers import runtime
from workers.celery_app import celery_app
from workers.engine import KVCacheOutOfMemory, RowSpec

log = logging.getLogger(__name__)
CLAIM_TTL_S = 7 * 24 * 3600


def _claim(rt: runtime.Runtime, batch_id: str) -> bool:
    """True when this instance may run the batch (first claim, or its own earlier claim)."""
    r = rt.redis
    if r.exists(bus.done_key(batch_id)):
        return False
    if r.set(bus.claim_key(batch_id), rt.name, nx=True, ex=CLAIM_TTL_S):
        return True
    return r.get(bus.claim_key(batch_id)) == rt.name


def _complete(rt: runtime.Runtime, event: dict[str, Any]) -> None:
    pipe = rt.redis.pipeline()
    pipe.set(bus.done_key(event["batch_id"]), event["type"], ex=CLAIM_TTL_S)
    pipe.lpush(bus.COMPLETIONS, bus.dumps(event))
    pipe.execute()


@celery_app.task(name="cohort.run_batch", acks_late=True)
def run_batch(batch: dict[str, Any]) -> dict[str, Any]:
    rt = runtime.get()
    b = Batch.from_dict(batch)
    if not _claim(rt, b.id):
        log.info("batch %s: already done, cancelled or claimed elsewhere; skipped", b.id)
        return {"batch_id": b.id, "skipped": True}
    emulate = rt.settings.emulate_lengths
    rows = [RowSpec(r.prompt, r.max_tokens, r.emulated_tokens if emulate else None) for r in b.requests]
    started = time.time()
    base = {"batch_id": b.id, "instance": rt.name, "started": started, "size": b.size}
    batch_row = {"id": b.id, "created": b.created, "started": started, "instance": rt.name,
                 "model": rt.settings.model, "size": b.size, "input_len": b.input_len,
                 "predicted_gen_len": b.predicted_gen_len, "attempt": b.attempt, "splits": b.splits}
    try:
        out = rt.engine.run(rows, b.requests[0].sampling)
    except KVCacheOutOfMemory as e:
        log.warning("batch %s (β=%d, L=%d, G'=%d) ran out of memory: %s", b.id, b.size, b.input_len,
                    b.predicted_gen_len, e)
        finished = time.time()
        _complete(rt, {**base, "type": "oom", "error": str(e), "finished": finished})
        record_batch(rt.db, {**batch_row, "finished": finished, "oom": True, "batch_time_s": finished - started})
        return {"batch_id": b.id, "oom": True}
    except Exception as e:  # anything else: fail the batch explicitly, never leave it hanging
        log.exception("batch %s failed", b.id)
        _complete(rt, {**base, "type": "failed", "error": f"{type(e).__name__}: {e}", "finished": time.time()})
        return {"batch_id": b.id, "failed": True}
    finished = time.time()
    for req, text, n in zip(b.requests, out.texts, out.generated_tokens, strict=True):
        bus.push_result(rt.redis, req.id, bus.result_message(
            req.id, ok=True, text=text, generated_tokens=n, predicted_tokens=req.predicted_tokens,
            input_tokens=req.input_tokens, batch={"id": b.id, "size": b.size},
            timings={"queued_s": started - req.arrival, "run_s": out.seconds, "total_s": finished - req.arrival}))
    _complete(rt, {**base, "type": "done", "finished": finished, "input_len": out.input_len,
                   "gen_len": out.gen_len, "seconds": out.seconds,
                   "generated_tokens": out.generated_tokens})
    record_batch(rt.db, {**batch_row, "finished": finished, "actual_gen_len": max(out.generated_tokens),
                         "batch_time_s": out.seconds, "peak_mem_bytes": out.peak_mem_bytes, "oom": False})
    for req, n in zip(b.requests, out.generated_tokens, strict=True):
        finish_request(rt.db, req.id, status="done", actual_tokens=n, batch_id=b.id,
                       queued_s=started - req.arrival, run_s=out.seconds, total_s=finished - req.arrival,
                       finished=finished)
    return {"batch_id": b.id, "seconds": out.seconds}
