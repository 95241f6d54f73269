"""The Redis protocol between gateway, batcher and workers: key names and message shapes.

gateway  --LPUSH incoming-->  batcher   (a ProfiledRequest as JSON)
gateway  --SET cancel:<id> + LPUSH cancels-->  batcher and worker (the client went away)
batcher  --Celery queue per pool-->  worker  (a Batch as JSON)
worker   --LPUSH completions-->  batcher (a CompletionEvent: outcome, measurements, continuations)
worker|batcher  --XADD stream:<request id>-->  gateway (StreamEvents: deltas, then end or error)

Message shapes are in cohort.protocol; this module owns the key names and the Redis operations.

The batcher's state lives in Redis too (``pending``: waiting requests, ``inflight``: dispatched
batches), so a restarted batcher picks up where the old one stopped.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from cohort.protocol import StreamEvent, StreamKind

PREFIX = "cohort"
INSTANCES = f"{PREFIX}:instances"      # hash instance name -> InstanceInfo JSON (each names its pool)
STATS = f"{PREFIX}:stats"              # hash of counters the gateway exports as metrics


@dataclass(frozen=True)
class PoolKeys:
    """One model pool's keys: every pool has its own queue, batcher state and batcher lock."""

    pool: str

    def _key(self, name: str) -> str:
        return f"{PREFIX}:pool:{self.pool}:{name}"

    @property
    def incoming(self) -> str:      # list of ProfiledRequest JSON, LPUSH'd by the gateway
        return self._key("incoming")

    @property
    def pending(self) -> str:       # hash request id -> request JSON (received, not dispatched)
        return self._key("pending")

    @property
    def inflight(self) -> str:      # hash batch id -> {"batch": ..., "dispatched": t}
        return self._key("inflight")

    @property
    def completions(self) -> str:   # list of CompletionEvent JSON, LPUSH'd by the workers
        return self._key("completions")

    @property
    def cancels(self) -> str:       # list of cancelled request ids (the batcher drops them)
        return self._key("cancels")

    @property
    def worst_priority(self) -> str:  # the least urgent priority waiting (absent: nothing waits)
        return self._key("worst_priority")

    @property
    def batcher_lock(self) -> str:  # one active batcher per pool
        return self._key("batcher:lock")


def pool_keys(pool: str) -> PoolKeys:
    return PoolKeys(pool)

STREAM_TTL_S = 3600
CANCEL_TTL_S = 3600
CLAIM_TTL_S = 7 * 24 * 3600            # batch claim / done markers: far longer than any redelivery
STREAM_FIELD = "e"                     # each stream entry carries one StreamEvent JSON in this field


def _client_options() -> dict:
    """Every long-lived client: retried with backoff on connection errors, pooled connections
    health-checked before use (a Redis restart leaves them stale), keep-alive on."""
    return dict(decode_responses=True, health_check_interval=10, socket_keepalive=True,
                socket_connect_timeout=5, retry_on_error=[RedisConnectionError, RedisTimeoutError])


def connect(url: str) -> redis.Redis:
    """A sync client for batcher and worker processes."""
    return redis.Redis.from_url(url, retry=Retry(ExponentialBackoff(cap=2.0, base=0.05), 6), **_client_options())


def connect_async(url: str, max_connections: int = 4096) -> aioredis.Redis:
    """An asyncio client for the gateway."""
    return aioredis.Redis.from_url(url, retry=AsyncRetry(ExponentialBackoff(cap=2.0, base=0.05), 6),
                                   max_connections=max_connections, **_client_options())


def stream_key(request_id: str) -> str:
    """A request's Redis Stream: its token deltas, then one end or error event."""
    return f"{PREFIX}:stream:{request_id}"


def cancel_key(request_id: str) -> str:
    """Present while a request is cancelled: the worker drops its row at the next step."""
    return f"{PREFIX}:cancel:{request_id}"


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


CANCELLED = "cancelled"  # a batch claim value: the batch was superseded, a redelivery is a no-op


def publish(pipe, request_id: str, event: StreamEvent) -> None:
    """Queue one event on a request's stream in ``pipe`` (a pipeline: the worker sends every
    row's events of a decode step in one round trip). Expiring, so abandoned streams go away."""
    key = stream_key(request_id)
    pipe.xadd(key, {STREAM_FIELD: event.to_json()})
    pipe.expire(key, STREAM_TTL_S)


def publish_now(redis, request_id: str, event: StreamEvent) -> None:
    """``publish`` in its own pipeline (sync client)."""
    pipe = redis.pipeline()
    publish(pipe, request_id, event)
    pipe.execute()


def cancel(pipe, request_id: str, pool: str) -> None:
    """Queue the withdrawal of a request in ``pipe`` (sync or redis.asyncio pipeline; the caller
    executes it): the cancel key tells the worker to drop the row at its next step, the id on
    the pool's cancels list tells its batcher to drop it from the waiting queue. Both in one round trip."""
    pipe.set(cancel_key(request_id), "1", ex=CANCEL_TTL_S)
    pipe.lpush(pool_keys(pool).cancels, request_id)


def cancelled_ids(redis, request_ids: Iterable[str]) -> set[str]:
    """Which of these requests were cancelled (one round trip)."""
    ids = list(request_ids)
    if not ids:
        return set()
    pipe = redis.pipeline()
    for rid in ids:
        pipe.exists(cancel_key(rid))
    return {rid for rid, hit in zip(ids, pipe.execute(), strict=True) if hit}


def stream_progress(redis, request_ids: Iterable[str]) -> dict[str, tuple[bool, list[int]]]:
    """For each request: whether its stream already holds a final event, and the token ids its
    deltas carried (what a client has been sent). One round trip; streams are short."""
    ids = list(request_ids)
    pipe = redis.pipeline()
    for rid in ids:
        pipe.xrange(stream_key(rid))
    out: dict[str, tuple[bool, list[int]]] = {}
    for rid, entries in zip(ids, pipe.execute(), strict=True):
        final, tokens = False, []
        for _, fields in entries:
            ev = StreamEvent.from_json(fields[STREAM_FIELD])
            final |= ev.final
            if ev.kind is StreamKind.DELTA:
                tokens.extend(ev.ids)
        out[rid] = (final, tokens)
    return out
