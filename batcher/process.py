"""The batcher process: hold the pool's batcher lock (one active batcher per pool; the lock's TTL
is its heartbeat) and step the ``BatcherService`` until told to stop, riding out Redis outages.
Kept apart from ``batcher.service``, which is the scheduling state machine itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable

import redis

from batcher.service import BatcherService
from cohort import bus
from cohort.heap import freeze_startup_heap
from cohort.settings import Settings
from cohort.types import Batch

log = logging.getLogger("cohort.batcher")
LOCK_TTL_S = 10


def _hold_lock(r: redis.Redis, lock: str, me: str) -> bool:
    """Take the pool's batcher lock, or extend it if we hold it: True while we are the active
    batcher. The lock's TTL doubles as the batcher's heartbeat (the gateway's /health reads it)."""
    if r.set(lock, me, nx=True, ex=LOCK_TTL_S):
        return True
    return r.get(lock) == me and bool(r.expire(lock, LOCK_TTL_S))


def run_batcher(settings: Settings, estimator: object, send_task: Callable[[Batch], None]) -> None:
    """The batcher process's main loop; the entry point injects the batch-time estimator and the
    Celery sender (the batcher itself knows neither the predictor package nor Celery).

    It rides out Redis outages: a connection error never ends the process; it waits with
    backoff and, once Redis answers again, rebuilds its state from Redis (``_recover``) under a
    re-taken lock, so a Redis restart, with or without persistence, loses nothing it had stored.
    """
    s = settings
    r = bus.connect(s.resolved_redis_url)
    freeze_startup_heap()  # a full collection walking the start-up heap would stall a round
    lock = bus.pool_keys(s.pool).batcher_lock
    me = f"{socket.gethostname()}-{os.getpid()}"
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    svc: BatcherService | None = None
    last_lock, backoff, more = 0.0, 0.2, False
    try:
        while not stop:
            try:
                if time.time() - last_lock > LOCK_TTL_S / 3 or svc is None:
                    if not _hold_lock(r, lock, me):
                        if svc is not None:
                            log.warning("batcher lock of pool %s lost to another batcher; standing by", s.pool)
                        svc = None
                        time.sleep(1.0)
                        continue
                    last_lock = time.time()
                    if svc is None:
                        svc = BatcherService(s, r, estimator, send_task)
                        log.info("batcher %s active: policy=%s execution=%s Φ=%.0f pool=%s", me, s.policy,
                                 s.execution, s.wma_threshold, s.pool)
                    maybe = getattr(estimator, "maybe_reload", None)
                    if maybe:
                        maybe()
                more = svc.step(wait_s=0.0 if more else s.batcher_tick_s)
                backoff = 0.2
            except redis.RedisError as e:
                log.warning("Redis unavailable (%s); retrying in %.1f s", e, backoff)
                svc = None  # rebuilt from Redis once it answers again
                time.sleep(backoff)
                backoff = min(backoff * 2, 5.0)
    except KeyboardInterrupt:
        pass
    finally:
        with contextlib.suppress(redis.RedisError):
            if r.get(lock) == me:
                r.delete(lock)
        log.info("batcher stopped")
