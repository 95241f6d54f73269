"""The Redis protocol between gateway, batcher and workers: key names and message shapes.

gateway  --reserve (Lua), then LPUSH incoming-->  batcher   (a ProfiledRequest as JSON)
gateway  --SET cancel:<id> + LPUSH cancels-->  batcher and worker (the client went away)
batcher  --Celery queue per pool-->  worker  (a Batch as JSON)
worker   --LPUSH completions-->  batcher (a CompletionEvent: outcome, measurements, continuations)
worker|batcher  --XADD stream:<request id>-->  gateway (StreamEvents: deltas, then end or error)
gateway|worker  --LPUSH wake-->  batcher (with every message above it reads: it blocks on this between rounds)

Message shapes are in cohort.protocol; this module owns the key names and the Redis operations.

The batcher's state lives in Redis too (``pending``: waiting requests, ``inflight``: dispatched
batches), so a restarted batcher picks up where the old one stopped.
"""

from __future__ import annotations

import math
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
from cohort.redis_packing import connection_class
from cohort.settings import get_settings

PREFIX = "cohort"
INSTANCES = f"{PREFIX}:instances"      # hash instance name -> InstanceInfo JSON (each names its pool)
STATS = f"{PREFIX}:stats"              # hash of counters the gateway exports as metrics
GENERATED_TOKENS = "generated_tokens"  # STATS field: every token a worker generated, whatever became of it


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
    def wake(self) -> str:          # list of at most one token: something for the batcher arrived
        return self._key("wake")

    @property
    def hungry(self) -> str:        # present while requests wait for room (``cohort.batcher_hunger``)
        return self._key("hungry")

    @property
    def worst_priority(self) -> str:  # the least urgent priority waiting (absent: nothing waits)
        return self._key("worst_priority")

    @property
    def batcher_lock(self) -> str:  # one active batcher per pool
        return self._key("batcher:lock")

    @property
    def reservations(self) -> str:  # sorted set request id -> expiry: admitted, not yet enqueued
        return self._key("reservations")


def pool_keys(pool: str) -> PoolKeys:
    return PoolKeys(pool)

CANCEL_TTL_S = 3600
STREAM_FIELD = "e"                     # each stream entry carries one StreamEvent JSON in this field
STREAM_RENEW_S = 30.0  # a writer renews an open stream's (far longer) expiry this often, not with every delta


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
                                   max_connections=max_connections, connection_class=connection_class(url),
                                   **_client_options())


RESERVATION_TTL_S = 30.0  # a reservation the gateway never enqueued (it died) frees its slot after this

# Admission's one atomic step (see ``reserve``). KEYS: incoming, pending, reservations,
# worst_priority; ARGV: now, expiry, max_pending, priority, request ids. Returns {admitted, depth}.
_RESERVE_LUA = """
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', ARGV[1])
local depth = redis.call('LLEN', KEYS[1]) + redis.call('HLEN', KEYS[2]) + redis.call('ZCARD', KEYS[3])
local n = #ARGV - 4
local admitted = depth + n <= tonumber(ARGV[3])
if not admitted then
  local worst = redis.call('GET', KEYS[4])
  admitted = worst ~= false and tonumber(ARGV[4]) < tonumber(worst)
end
if not admitted then
  return {0, depth}
end
for i = 5, #ARGV do
  redis.call('ZADD', KEYS[3], ARGV[2], ARGV[i])
end
return {1, depth}
"""


async def reserve(redis: aioredis.Redis, pool: str, request_ids: list[str], priority: int, max_pending: int,
                  now: float) -> tuple[bool, int]:
    """Admission control as one Redis step: take a slot in the pool's queue for each request, or
    none. Admitted iff the requests waiting (incoming + pending + reserved) leave room for them
    all under ``max_pending``, or they are more urgent than the least urgent waiting request
    (``worst_priority``, published by the batcher, which then sheds the least urgent). Stale
    reservations (a gateway that died between ``reserve`` and ``enqueue``) expire here first.

    Why a reservation and not the push itself: the gateway writes the log-DB row between the
    two (a client that sees its request's answer must find its record), and a refused request
    must leave no row. Returns (admitted, depth seen)."""
    k = pool_keys(pool)
    script = redis.register_script(_RESERVE_LUA)
    admitted, depth = await script(keys=[k.incoming, k.pending, k.reservations, k.worst_priority],
                                   args=[now, now + RESERVATION_TTL_S, max_pending, priority, *request_ids])
    return bool(admitted), int(depth)


async def enqueue(redis: aioredis.Redis, pool: str, request_ids: list[str], payloads: list[str]) -> None:
    """Hand reserved requests to the batcher: one LPUSH (they can share a batch) and the drop of
    their reservations in one transaction, so a request is counted once at every instant."""
    k = pool_keys(pool)
    pipe = redis.pipeline(transaction=True)
    pipe.zrem(k.reservations, *request_ids)
    pipe.lpush(k.incoming, *payloads)
    wake_batcher(pipe, pool)
    await pipe.execute()


def wake_batcher(pipe, pool: str) -> None:
    """Queue, in ``pipe`` (sync or asyncio), the token that ends the pool's batcher's wait between
    rounds (``wait_for_work``): every producer of a message the batcher reads (an arrival, a cancel,
    a completion, an admission) sends it beside the message, so a request that reaches an idle
    batcher is scheduled at once instead of at its next tick. Kept to one token (LTRIM): a batcher
    that is down does not come back to a long list, and one token is enough to end one wait; the
    messages themselves stay on their own lists."""
    k = pool_keys(pool)
    pipe.lpush(k.wake, 1)
    pipe.ltrim(k.wake, 0, 0)


def wait_for_work(redis: redis.Redis, pool: str, timeout_s: float) -> bool:
    """The batcher's idle wait: until a producer wakes it (``wake_batcher``) or ``timeout_s`` passes
    (its tick: heartbeats, lost batches and the gateway's timeouts are still checked by time).
    True when woken. A token pushed while the batcher was busy ends the next wait at once, so no
    message waits a tick unseen."""
    pipe = redis.pipeline(transaction=False)
    queue_wait(pipe, pool, timeout_s)
    return pipe.execute()[0] is not None


def queue_wait(pipe, pool: str, timeout_s: float) -> None:
    """Queue the wait of ``wait_for_work`` in a plain (non-transaction) pipeline, first: Redis runs
    a connection's commands in order, so the commands queued after it run when it ends and read
    what the wake announced — the batcher's round reads in one round trip. ``timeout_s`` 0: take
    a token left over without waiting (the batcher knows there is more to read)."""
    if timeout_s > 0:
        pipe.blpop([pool_keys(pool).wake], timeout=max(timeout_s, 0.001))
    else:
        pipe.lpop(pool_keys(pool).wake)


async def release(redis: aioredis.Redis, pool: str, request_ids: list[str]) -> None:
    """Give reserved slots back (admission failed after ``reserve``)."""
    await redis.zrem(pool_keys(pool).reservations, *request_ids)


def stream_key(request_id: str) -> str:
    """A request's Redis Stream: its token deltas, then one end or error event."""
    return f"{PREFIX}:stream:{request_id}"


def hub_wake_key(hub: str) -> str:
    """A gateway's stream hub's own stream: an entry ends its blocking read (gateway.stream_hub)."""
    return f"{PREFIX}:hubwake:{hub}"


def cancel_key(request_id: str) -> str:
    """Present while a request is cancelled: the worker drops its row at the next step."""
    return f"{PREFIX}:cancel:{request_id}"


def alive_key(instance: str) -> str:
    """Heartbeat key with a TTL: present while the instance's worker process lives."""
    return f"{PREFIX}:instance:{instance}:alive"


def marker_ttl_s(visibility_timeout_s: float) -> int:
    """How long a batch's claim / admitted / done markers live: twice the broker's visibility
    timeout. A task message that was never acked comes back at most one visibility timeout after
    its last delivery, which is before its batch ended, so a marker that outlives it by another
    timeout stops every redelivery; longer would only fill Redis (one small group per request
    under continuous execution: a 7-day TTL grew Redis by ~3.6 MB/h at 5 req/s)."""
    return int(2 * visibility_timeout_s)


def claim_key(batch_id: str) -> str:
    """Which instance runs a batch (SET NX): makes a redelivered task a no-op."""
    return f"{PREFIX}:batch:{batch_id}:claim"


def done_key(batch_id: str) -> str:
    return f"{PREFIX}:batch:{batch_id}:done"


def admitted_key(batch_id: str) -> str:
    """Set by the worker when a batch's rows start running (continuous execution: when the group
    joined the running rows). The batcher keeps one batch per instance waiting to be admitted."""
    return f"{PREFIX}:batch:{batch_id}:admitted"


def queue_admitted(pipe, batch_ids: list[str]) -> None:
    """Queue the reads of which of these batches a worker has admitted in ``pipe`` (one reply per
    batch, truthy when admitted): the batcher reads them with its round (``Intake._read``)."""
    for bid in batch_ids:
        pipe.exists(admitted_key(bid))


def unfinished_claims(r: redis.Redis, batch_ids: list[str]) -> dict[str, str | None]:
    """Of these batches, those without a done marker, and who claimed each (None: nobody yet).
    One round trip: under continuous execution an instance runs dozens of batches, and the
    batcher checks them every round."""
    if not batch_ids:
        return {}
    pipe = r.pipeline(transaction=False)
    for bid in batch_ids:
        pipe.exists(done_key(bid))
        pipe.get(claim_key(bid))
    res = pipe.execute()
    return {bid: res[2 * i + 1] for i, bid in enumerate(batch_ids) if not res[2 * i]}


def redis_uptime_s(r: redis.Redis) -> float:
    """Seconds since the Redis server started: a server younger than an instance's heartbeat TTL
    may have come back without the heartbeats (no persistence, or expired while it was down) of
    instances that are alive and will beat again once their clients reconnect. Infinite where the
    server does not say (a proxy or an emulation without INFO)."""
    try:
        return float(r.info("server")["uptime_in_seconds"])
    except (redis.ResponseError, KeyError):
        return math.inf


def alive(r: redis.Redis, instances: Iterable[str | None]) -> dict[str, bool]:
    """Whether each named instance's heartbeat is still there (one round trip); claim markers
    that name no instance (None, ``CANCELLED``) are left out."""
    names = sorted({n for n in instances if n and n != CANCELLED})
    if not names:
        return {}
    pipe = r.pipeline(transaction=False)
    for name in names:
        pipe.exists(alive_key(name))
    return {name: bool(hit) for name, hit in zip(names, pipe.execute(), strict=True)}


def queue_for_pool(pool: str) -> str:
    """The Celery queue of a model pool."""
    return f"{PREFIX}.pool.{pool}"


def queue_for_instance(instance: str) -> str:
    """One instance's own Celery queue: batches routed to it (prefix-aware routing). The instance
    consumes it beside its pool's queue; the batcher deletes it when the instance is gone."""
    return f"{PREFIX}.instance.{instance}"


def prefix_summary_key(instance: str) -> str:
    """The keys of the KV pages an instance has cached (``batcher.prefix_pages.encode_summary``),
    rewritten with its heartbeat and expiring with it."""
    return f"{PREFIX}:instance:{instance}:prefixes"


def prefix_summaries(r: redis.Redis, instances: Iterable[str]) -> dict[str, str | None]:
    """Each instance's published prefix summary (None: it publishes none), one round trip."""
    names = sorted(instances)
    if not names:
        return {}
    return dict(zip(names, r.mget([prefix_summary_key(n) for n in names]), strict=True))


CANCELLED = "cancelled"  # a batch claim value: the batch was superseded, a redelivery is a no-op


def stream_ttl_s(final: bool) -> int:
    """How long a stream lives after this write (streams were kept an hour, +248 MB/h
    at 10 req/s). After the final event: COHORT_STREAM_END_TTL_S, long enough for the gateway to
    read it (it reads within COHORT_DISCONNECT_CHECK_S) and for the batcher to see the row is
    answered if its batch is lost soon after. Open: COHORT_REQUEST_TIMEOUT_S + that, renewed on
    every write, so only a stream nobody writes to or waits for any more expires. Redis memory
    is then ~ rate x stream bytes x end TTL (docs/notes/retention.md)."""
    s = get_settings()
    end = int(s.stream_end_ttl_s)
    return end if final else int(s.request_timeout_s) + end


def publish(pipe, request_id: str, event: StreamEvent, renew: bool = True) -> None:
    """Queue one event on a request's stream in ``pipe`` (the worker sends a decode step's events in
    one round trip). Expiring (``stream_ttl_s``), so answered and abandoned streams go away; with
    ``renew`` False (renewed within ``STREAM_RENEW_S``) only a final event sets the expiry."""
    key = stream_key(request_id)
    pipe.xadd(key, {STREAM_FIELD: event.to_json()})
    if renew or event.final:
        pipe.expire(key, stream_ttl_s(event.final))


def cancelled_flags(pipe, request_ids: list[str]) -> None:
    """Queue one MGET of these requests' cancel keys, not an EXISTS a row (``read_cancelled``)."""
    if request_ids:
        pipe.mget([cancel_key(rid) for rid in request_ids])


def read_cancelled(reply: list) -> list[bool]:
    return [value is not None for value in reply]  # ``cancelled_flags``'s reply: a value, a cancel


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
    wake_batcher(pipe, pool)


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
