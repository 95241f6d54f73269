"""The Redis keys of the upstream path's short cuts: the groups the batcher hands an upstream-only
pool on plain lists (no Celery task per group: ``group_list``), and direct streaming, where a gateway
streams a row from its upstream engine itself (``protocol.Release`` / ``protocol.StreamReport``):
the gateway's inbox of releases and its liveness, the upstream instance's inbox of reports.
Everything else crosses on ``cohort.bus``."""

from __future__ import annotations

from cohort.bus import PREFIX

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


def group_list(pool: str, instance: str | None = None) -> str:
    """A list of ``Batch`` JSON: groups for any upstream instance of ``pool``, or routed to one."""
    return f"{PREFIX}:groups:{pool}" if instance is None else f"{PREFIX}:groups:{pool}:{instance}"


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
