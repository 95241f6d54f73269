"""A job row's request, sent again, follows the request already in the system.

Why: when the gateway restarts (or the job runner loses its connection) a row's request goes on
in the batcher and the worker with no one reading its answer; the runner then sends the row again.
Running it twice would cost the work twice (the log DB keeps the row answered once either way).
So the runner names each attempt's request id (``cohort.apikeys.row_request_id``, header
``ROW_REQUEST_HEADER``, believed only from the runner: ``gateway.auth``); a row sent again names the
same id, and when the log DB has that request still ``queued`` (waiting or running), or ``done``
with its stream still in Redis, the gateway reads that request's stream from its start instead of
admitting a new one. A request that failed, was cancelled or whose stream expired is not followed:
the row runs again under a fresh id that still starts with the row's (so what ran twice is counted).
"""

from __future__ import annotations

from contextvars import ContextVar

from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from cohort import bus
from cohort.logdb import requests
from cohort.types import new_id

_ROW_REQUEST: ContextVar[str | None] = ContextVar("cohort_row_request", default=None)


def name_row_request(request_id: str | None):
    """Set (by gateway.auth, for the runner's requests only) the id this HTTP request's generation
    request is to have; returns the token to reset it with."""
    return _ROW_REQUEST.set(request_id or None)


def reset_row_request(token) -> None:
    _ROW_REQUEST.reset(token)


def _status(engine, request_id: str) -> str | None:
    with engine.connect() as conn:
        return conn.execute(select(requests.c.status).where(requests.c.id == request_id)).scalar()


async def row_request(app_state, copies: int) -> tuple[str | None, bool]:
    """The id a job row's request is to have (None: not a row, or ``n`` > 1) and whether that
    request is already in the system to be followed (True) rather than admitted."""
    rid = _ROW_REQUEST.get()
    if rid is None or copies != 1:
        return None, False
    status = await run_in_threadpool(_status, app_state.db, rid)
    if status is None:
        return rid, False
    if status == "queued" or (status == "done" and await app_state.redis.exists(bus.stream_key(rid))):
        return rid, True
    return new_id(rid), False  # failed, cancelled or its stream expired: a fresh request, still named by the row
