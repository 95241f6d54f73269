"""The Redis protocol between gateway, batcher and workers: key names and message shapes.

gateway  --LPUSH incoming-->  batcher   (a ProfiledRequest as JSON)
batcher  --Celery queue per pool-->  worker  (a Batch as JSON)
worker   --LPUSH completions-->  batcher (batch done / oom / failed, with measurements)
worker|batcher  --RPUSH result:<request id>-->  gateway (the answer or an explicit failure)

The batcher's state lives in Redis too (``pending``: waiting requests, ``inflight``: dispatched
batches), so a restarted batcher picks up where the old one stopped.
"""

from __future__ import annotations

import json
import time
from typing import Any

PREFIX = "cohort"
INCOMING = f"{PREFIX}:incoming"
COMPLETIONS = f"{PREFIX}:completions"
PENDING = f"{PREFIX}:pending"          # hash request id -> request JSON (received, not dispatched)
INFLIGHT = f"{PREFIX}:inflight"        # hash batch id -> {"batch": ..., "dispatched": t, "queue": q}
INSTANCES = f"{PREFIX}:instances"      # hash instance name -> InstanceInfo JSON
STATS = f"{PREFIX}:stats"              # hash of counters the gateway exports as metrics
BATCHER_LOCK = f"{PREFIX}:batcher:lock"  # one active batcher
RESULT_TTL_S = 3600


def result_key(request_id: str) -> str:
    return f"{PREFIX}:result:{request_id}"


def alive_key(instance: str) -> str:
    """Heartbeat key with a TTL: present while the instance's worker process lives."""
    return f"{PREFIX}:instance:{instance}:alive"


def claim_key(batch_id: str) -> str:
    """Which instance runs a batch (SET NX): makes a redelivered task a no-op."""
    return f"{PREFIX}:batch:{batch_id}:claim"


def done_key(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:done"


def queue_for_pool(pool: str) -> str:
    """The Celery queue of a model pool."""
    return f"{PREFIX}.pool.{pool}"


CANCELLED = "cancelled"


def dumps(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"))


def result_message(request_id: str, *, ok: bool, **fields: Any) -> str:
    """What the gateway waits for: ``ok`` plus either the answer fields or ``error``/``code``."""
    return dumps({"id": request_id, "ok": ok, "time": time.time(), **fields})


def push_result(redis, request_id: str, message: str) -> None:
    """Deliver one request's answer (sync client). Expiring, so abandoned answers don't pile up."""
    key = result_key(request_id)
    pipe = redis.pipeline()
    pipe.rpush(key, message)
    pipe.expire(key, RESULT_TTL_S)
    pipe.execute()
