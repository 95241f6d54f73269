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

from cohort.protocol import StreamEvent, StreamKind

PREFIX = "cohort"
INCOMING = f"{PREFIX}:incoming"
COMPLETIONS = f"{PREFIX}:completions"
PENDING = f"{PREFIX}:pending"          # hash request id -> request JSON (received, not dispatched)
INFLIGHT = f"{PREFIX}:inflight"        # hash batch id -> {"batch": ..., "dispatched": t, "queue": q}
INSTANCES = f"{PREFIX}:instances"      # hash instance name -> InstanceInfo JSON
STATS = f"{PREFIX}:stats"              # hash of counters the gateway exports as metrics
BATCHER_LOCK = f"{PREFIX}:batcher:lock"  # one active batcher
CANCELS = f"{PREFIX}:cancels"          # list of cancelled request ids (the batcher drops them)
STREAM_TTL_S = 3600
CANCEL_TTL_S = 3600
CLAIM_TTL_S = 7 * 24 * 3600            # batch claim / done markers: far longer than any redelivery
STREAM_FIELD = "e"                     # each stream entry carries one StreamEvent JSON in this field


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


def cancel(pipe, request_id: str) -> None:
    """Queue the withdrawal of a request in ``pipe`` (sync or redis.asyncio pipeline; the caller
    executes it): the cancel key tells the worker to drop the row at its next step, the id on
    CANCELS tells the batcher to drop it from the waiting queue. Both in one round trip."""
    pipe.set(cancel_key(request_id), "1", ex=CANCEL_TTL_S)
    pipe.lpush(CANCELS, request_id)


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
