"""OpenAI's Batch API: create, retrieve, list (after/limit), cancel.

The gateway only records a job (``validating``) and answers about it; the job runner (offline/,
a process of its own) validates the input file, sends the rows through the ordinary submit path
at a background priority, and moves the job through OpenAI's statuses:
validating → in_progress → finalizing → completed, or failed (not a batch file), expired (the
window passed: finished rows kept), cancelling → cancelled (queued rows stopped, finished kept).
``request_counts`` are read from the rows at each request, so they are never stale.

``completion_window`` is OpenAI's ``24h``; shorter windows (``30m``, ``2h``, ``90s``) are a cohort
extension, for jobs that should finish sooner (their rows rise in priority sooner).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from cohort import jobdb
from cohort.types import new_id
from gateway.auth import owner_of
from gateway.errors import APIError
from gateway.views.files import owned_file

router = APIRouter(tags=["batches"])

ENDPOINTS = jobdb.BATCH_ENDPOINTS
CANCELLABLE = ("validating", "in_progress")
_WINDOW = re.compile(r"(\d{1,6})(s|m|h)")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 24 * 3600


class BatchCreate(BaseModel):
    input_file_id: str = Field(max_length=64)
    endpoint: str = Field(max_length=64)
    completion_window: str = Field(default="24h", max_length=16)
    metadata: dict[str, str] | None = None


def window_seconds(window: str) -> int:
    """Seconds of a completion window (``24h``; ``Nh``/``Nm``/``Ns`` up to 24 h), or a 400."""
    m = _WINDOW.fullmatch(window)
    seconds = int(m.group(1)) * _UNIT_S[m.group(2)] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise APIError(400, f"completion_window {window!r} is not supported: use '24h' (or a shorter 'Nh', 'Nm', "
                       "'Ns')", code="invalid_value", param="completion_window")
    return seconds


def batch_object(row: dict[str, Any], counts: dict[str, int]) -> dict[str, Any]:
    """A job's record as OpenAI's ``batch`` object."""
    done, failed = counts.get(jobdb.ROW_DONE, 0), counts.get(jobdb.ROW_ERROR, 0)
    errors = json.loads(row["errors"]) if row["errors"] else None
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{k: row[k] for k in ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at",
                                   "failed_at", "expired_at", "cancelling_at", "cancelled_at")},
            "request_counts": {"total": sum(counts.values()) or (row["total"] or 0), "completed": done,
                               "failed": failed},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None}


async def _object(db, row: dict[str, Any]) -> dict[str, Any]:
    return batch_object(row, await run_in_threadpool(jobdb.row_counts, db, row["id"]))


async def _owned(request: Request, batch_id: str) -> dict[str, Any]:
    row = await run_in_threadpool(jobdb.get_batch, request.app.state.db, batch_id, owner_of(request))
    if row is None:
        raise APIError(404, f"No such Batch object: {batch_id}", code="batch_not_found", param="batch_id")
    return row


@router.post("/v1/batches")
async def create(body: BatchCreate, request: Request) -> dict[str, Any]:
    db = request.app.state.db
    if body.endpoint not in ENDPOINTS:
        raise APIError(400, f"endpoint {body.endpoint!r} is not supported; use one of {', '.join(ENDPOINTS)}",
                       code="invalid_value", param="endpoint")
    window = window_seconds(body.completion_window)
    if body.metadata is not None and (len(body.metadata) > 16 or any(len(k) > 64 or len(v) > 512
                                                                      for k, v in body.metadata.items())):
        raise APIError(400, "metadata holds at most 16 pairs, keys up to 64 and values up to 512 characters",
                       code="invalid_value", param="metadata")
    f = await owned_file(request, body.input_file_id)
    if f["purpose"] != "batch":
        raise APIError(400, f"file {f['id']} has purpose {f['purpose']!r}; a batch needs a file uploaded with "
                       "purpose 'batch'", code="invalid_value", param="input_file_id")
    now = int(time.time())
    row = {"id": new_id("batch"), "owner": owner_of(request), "created_at": now, "endpoint": body.endpoint,
           "input_file_id": f["id"], "completion_window": body.completion_window, "status": "validating",
           "metadata": json.dumps(body.metadata) if body.metadata else None, "expires_at": now + window,
           "total": 0, "completed": 0, "failed": 0}
    await run_in_threadpool(jobdb.create_batch, db, row)
    return await _object(db, await run_in_threadpool(jobdb.get_batch, db, row["id"]))


@router.get("/v1/batches/{batch_id}")
async def retrieve(request: Request, batch_id: str) -> dict[str, Any]:
    return await _object(request.app.state.db, await _owned(request, batch_id))


@router.get("/v1/batches")
async def batches_list(request: Request, after: str | None = None, limit: int = 20) -> dict[str, Any]:
    if not 1 <= limit <= 100:
        raise APIError(400, "limit must be between 1 and 100", code="invalid_value", param="limit")
    db = request.app.state.db
    rows, more = await run_in_threadpool(jobdb.list_batches, db, owner_of(request), after, limit)
    data = [await _object(db, r) for r in rows]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": more}


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    db = request.app.state.db
    row = await _owned(request, batch_id)
    if row["status"] not in (*CANCELLABLE, "cancelling", "cancelled"):
        raise APIError(409, f"Cannot cancel a batch with status {row['status']!r}", code="invalid_state",
                       param="batch_id")
    await run_in_threadpool(lambda: jobdb.set_batch(db, batch_id, from_status=CANCELLABLE, status="cancelling",
                                                    cancelling_at=int(time.time())))
    return await _object(db, await run_in_threadpool(jobdb.get_batch, db, batch_id))
