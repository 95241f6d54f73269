"""OpenAI's Files API for batch input and output: upload, list, retrieve, content, delete.

Only ``purpose: batch`` is accepted for uploads (cohort has no other use for a file); the job
runner adds the ``batch_output`` files (output and error lines). A file belongs to the API key
that uploaded it (its job's key, for outputs): any other key is answered 404, as if it did not
exist. The size limit is ``COHORT_MAX_FILE_BYTES``; the body limit of the other routes does not
apply here (gateway.validation.BodyLimit lets this route's larger bodies through).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, File, Form, Request, UploadFile
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from cohort import jobdb
from cohort.filestore import FileStore
from cohort.types import new_id
from gateway.auth import owner_of
from gateway.errors import APIError

router = APIRouter(tags=["files"])

UPLOAD_PURPOSES = ("batch",)
CHUNK = 1 << 20


def file_object(row: dict[str, Any]) -> dict[str, Any]:
    """A file's record as OpenAI's ``file`` object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed",
            "status_details": None, "expires_at": None}


def store_of(request: Request) -> FileStore:
    return FileStore(request.app.state.settings.resolved_files_dir)


async def owned_file(request: Request, file_id: str) -> dict[str, Any]:
    """The caller's file, or 404 (another key's file is not there, for this caller)."""
    row = await run_in_threadpool(jobdb.get_file, request.app.state.db, file_id, owner_of(request))
    if row is None:
        raise APIError(404, f"No such File object: {file_id}", code="file_not_found", param="file_id")
    return row


@router.post("/v1/files")
async def upload(request: Request, file: UploadFile = File(...), purpose: str = Form(...)) -> dict[str, Any]:
    s = request.app.state.settings
    if purpose not in UPLOAD_PURPOSES:
        raise APIError(400, f"purpose {purpose!r} is not supported: cohort takes files for 'batch' only",
                       code="invalid_value", param="purpose")
    data, size = bytearray(), 0
    while chunk := await file.read(CHUNK):
        size += len(chunk)
        if size > s.max_file_bytes:
            raise APIError(413, f"the file is larger than {s.max_file_bytes} bytes (COHORT_MAX_FILE_BYTES)",
                           code="file_too_large", param="file")
        data.extend(chunk)
    if not data.strip():
        raise APIError(400, "the file is empty", code="empty_file", param="file")
    try:
        bytes(data).decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "a batch file must be UTF-8 text (JSONL)", code="invalid_file", param="file") from None
    fid = new_id("file")
    row = {"id": fid, "owner": owner_of(request), "created_at": int(time.time()), "bytes": size,
           "filename": (file.filename or "upload.jsonl")[:512], "purpose": purpose}
    await run_in_threadpool(store_of(request).write, fid, bytes(data))
    await run_in_threadpool(jobdb.add_file, request.app.state.db, row)
    return file_object(row)


@router.get("/v1/files")
async def files_list(request: Request, purpose: str | None = None, after: str | None = None,
                     limit: int = 10000) -> dict[str, Any]:
    if not 1 <= limit <= 10000:
        raise APIError(400, "limit must be between 1 and 10000", code="invalid_value", param="limit")
    rows = await run_in_threadpool(jobdb.list_files, request.app.state.db, owner_of(request), purpose, after,
                                   limit + 1)
    data = [file_object(r) for r in rows[:limit]]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}


@router.get("/v1/files/{file_id}")
async def retrieve(request: Request, file_id: str) -> dict[str, Any]:
    return file_object(await owned_file(request, file_id))


@router.get("/v1/files/{file_id}/content")
async def content(request: Request, file_id: str) -> Response:
    row = await owned_file(request, file_id)
    try:
        data = await run_in_threadpool(store_of(request).read, row["id"])
    except FileNotFoundError:
        raise APIError(404, f"the content of {file_id} is gone from the file store", code="file_not_found",
                       param="file_id") from None
    return Response(data, media_type="application/octet-stream",
                    headers={"content-disposition": f'attachment; filename="{row["filename"]}"'})


@router.delete("/v1/files/{file_id}")
async def delete(request: Request, file_id: str) -> dict[str, Any]:
    row = await owned_file(request, file_id)
    await run_in_threadpool(jobdb.delete_file, request.app.state.db, row["id"])
    await run_in_threadpool(store_of(request).delete, row["id"])
    return {"id": row["id"], "object": "file", "deleted": True}
