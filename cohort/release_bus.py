"""The Redis keys of the upstream path's short cuts: the groups the batcher hands an upstream-only
pool on sorted sets (no Celery task per group: ``group_set``), and direct streaming, where a gateway
streams a row from its upstream engine itself (``protocol.Release`` / ``protocol.StreamReport``):
the gateway's inbox of releases and its liveness, the upstream instance's inbox of reports.
Everything else crosses on ``cohort.bus``."""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from typing import Any, TypeVar

from cohort.bus import PREFIX, queue_for_instance, queue_for_pool

log = logging.getLogger(__name__)
T = TypeVar("T")

GATEWAY_ALIVE_TTL_S = 10  # a gateway that stopped refreshing this long ago is gone: its rows have no reader
INBOX_TAKE = 256  # messages one read of an inbox takes at most


def gateway_inbox(gateway: str) -> str:
    """A list of ``protocol.Release`` JSON: rows the gateway streams from their engine itself."""
    return f"{PREFIX}:gateway:{gateway}:releases"


def gateway_alive_key(gateway: str) -> str:
    """Set (with ``GATEWAY_ALIVE_TTL_S``) while the gateway process runs."""
    return f"{PREFIX}:gateway:{gateway}:alive"


def instance_inbox(instance: str) -> str:
    """A list of JSON arrays of ``protocol.StreamReport``: what the gateways' streams of an upstream
    instance's rows did."""
    return f"{PREFIX}:instance:{instance}:reports"


def group_set(pool: str, instance: str | None = None) -> str:
    """A sorted set of ``Batch`` JSON (``hand_over``): groups for any upstream instance of
    ``pool``, or routed to one, taken best first (``BZPOPMIN``). Named apart from the plain lists
    earlier versions kept groups on (``groups:``), so that an upgrade over a live Redis meets no key
    of the other type: a group left on an old list is unclaimed, and the batcher re-queues it."""
    return f"{PREFIX}:groupset:{pool}" if instance is None else f"{PREFIX}:groupset:{pool}:{instance}"


def _sortable(key: float) -> str:
    """``key`` as 16 hex digits whose text order is the numbers' order (IEEE 754 bits, the sign
    flipped for positives and every bit for negatives)."""
    (bits,) = struct.unpack(">Q", struct.pack(">d", float(key)))
    return f"{bits ^ 0xFFFFFFFFFFFFFFFF if bits >> 63 else bits | 1 << 63:016x}"


def hand_over(pipe: Any, key: str, priority: int, rank: float, payload: str) -> None:
    """Queue (on ``pipe``) a group's ``Batch`` JSON onto its sorted set ``key`` (``group_set``),
    where instances take the waiting groups in the policy's order rather than the order they were
    handed over: the most urgent client ``priority`` first (the score), then the lowest ``rank``
    (the policy's rank at hand-over, or the hand-over time where its order changes with time: the
    member's sortable prefix, since Redis orders members of one score by their bytes). A group that
    fits on no instance waits there, and a shorter one handed over after it passes it
    (docs/notes/fleet.md)."""
    pipe.zadd(key, {f"{_sortable(rank)}|{payload}": priority})


def queued_text(redis: Any, pool: str, targets: set[str | None]) -> str:
    """Everything waiting to be taken on the pool's queues and those of the instances ``targets``
    (Celery's lists, an upstream-only pool's sorted sets), as one raw text to look batch ids up in:
    one round trip."""
    names = sorted(t for t in targets if t)
    pipe = redis.pipeline(transaction=False)
    for q in [queue_for_pool(pool), *map(queue_for_instance, names)]:
        pipe.lrange(q, 0, -1)
    for q in [group_set(pool), *(group_set(pool, t) for t in names)]:
        pipe.zrange(q, 0, -1)
    return "".join(m for got in pipe.execute() for m in got)


def group_payload(member: str) -> str:
    """The ``Batch`` JSON of a sorted set's member (``hand_over``: after the rank's prefix)."""
    return member.partition("|")[2]


async def take_inbox(conn, key: str, timeout_s: float = 1.0) -> list[str]:
    """Wait (at most ``timeout_s``) for messages on an inbox list and take up to ``INBOX_TAKE`` of
    them in one round trip: a BLPOP, then an LPOP of what else is there, pipelined (Redis runs a
    connection's commands in order, so the LPOP reads when the wait ends). ``conn``: an asyncio
    client of its own (a blocking read holds its connection)."""
    pipe = conn.pipeline(transaction=False)
    pipe.blpop([key], timeout=timeout_s)
    pipe.lpop(key, INBOX_TAKE - 1)
    got, more = await pipe.execute()
    return ([got[1]] if got else []) + (more or [])


async def serve_inbox(conn, key: str, handle: Callable[[str], None], what: str) -> None:
    """Take an inbox's messages (``take_inbox``) until cancelled, each to ``handle``. A Redis outage
    is waited out (0.2 s, doubling up to 5 s, as every reader does); a message ``handle`` cannot
    apply is logged and skipped, never the end of the reader."""
    backoff = 0.2
    while True:
        try:
            msgs = await take_inbox(conn, key)
            backoff = 0.2
        except Exception as e:
            log.warning("reading %s failed (%s); retrying in %.1f s", what, e, backoff)
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
            continue
        for js in msgs:
            try:
                handle(js)
            except Exception:
                log.exception("%s: a message could not be applied: %.200s", what, js)


async def push_in_order(redis: Any, waiting: dict[str, list[T]], key: Callable[[str], str],
                        encode: Callable[[list[T]], list[str]], what: str,
                        pause_s: float = 0.2, max_pause_s: float = 5.0,
                        also: Callable[[Any], None] | None = None) -> None:
    """Push the messages ``waiting`` (destination -> messages, in the order they must arrive) until
    none wait: one pipeline of an RPUSH of ``encode(messages)`` onto ``key(destination)`` each, one
    push at a time. A push that waits for Redis (its client retries for seconds) must not be
    overtaken by a later one: a gateway would run a row's stale release after its continuation's,
    a worker would take a row's end and drop the progress that came after it. What a failed push
    held goes back in front of what arrived since, and is pushed again after a pause (``pause_s``,
    doubling up to ``max_pause_s``; back to ``pause_s`` after a push that went through).

    ``waiting`` is emptied in place: its owner adds to the same dict while a push is under way. The
    owner runs one of these at a time (a second would overtake the first's retry). ``also``: more
    commands (idempotent ones) for the first push, queued again on each retry until one went through."""
    pause = pause_s
    while waiting or also is not None:
        out = dict(waiting)
        waiting.clear()
        try:
            pipe = redis.pipeline(transaction=False)
            for dest, msgs in out.items():
                pipe.rpush(key(dest), *encode(msgs))
            if also is not None:
                also(pipe)
            await pipe.execute()
            also, pause = None, pause_s
        except Exception as e:  # Redis gone: the messages wait for it (their readers still wait)
            log.warning("sending %d %s failed (%s); retrying in %.1f s",
                        sum(map(len, out.values())), what, e, pause)
            for dest, msgs in out.items():
                waiting.setdefault(dest, [])[:0] = msgs
            await asyncio.sleep(pause)
            pause = min(max_pause_s, pause * 2)
