"""/admin/keys: create, list and revoke API keys for /v1; usage per key.

Behind the admin token like every /admin route (mounted only when ``COHORT_ADMIN_TOKEN`` is
set). A created key is shown once, in the creation answer: the log DB keeps only its hash
(cohort.apikeys). Revoking takes effect at once in this gateway and within
``gateway.auth.REFRESH_S`` in any other.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from cohort import jobdb
from cohort.apikeys import configured_keys, env_key_id, hash_key, new_key
from cohort.settings import Settings
from cohort.types import new_id
from gateway.admin import bearer_check
from gateway.errors import APIError


class KeyCreate(BaseModel):
    name: str | None = Field(default=None, max_length=128)
    rpm: int | None = Field(default=None, ge=0, description="Requests per minute (0: none; unset: COHORT_API_KEY_RPM)")
    tpm: int | None = Field(default=None, ge=0, description="Tokens per minute (0: none; unset: COHORT_API_KEY_TPM)")


def _shown(row: dict[str, Any], used: dict[str, Any]) -> dict[str, Any]:
    return {"id": row["id"], "name": row["name"], "prefix": row["prefix"], "created": row["created"],
            "revoked": row["revoked"], "rpm": row["rpm"], "tpm": row["tpm"],
            "usage": used.get(row["id"], {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})}


def make_keys_router(settings: Settings) -> APIRouter:
    router = APIRouter(prefix="/admin/keys", tags=["admin"], dependencies=[Depends(bearer_check(settings.admin_token))])

    @router.post("", status_code=201)
    async def create(body: KeyCreate, request: Request) -> dict[str, Any]:
        st = request.app.state
        key = new_key()
        row = {"id": new_id("key"), "hash": hash_key(key), "name": body.name, "prefix": key[:14],
               "created": time.time(), "revoked": None, "rpm": body.rpm, "tpm": body.tpm}
        await run_in_threadpool(jobdb.add_key, st.db, row)
        await run_in_threadpool(st.keys.refresh, st.db)
        return {**_shown(row, {}), "key": key}

    @router.get("")
    async def listing(request: Request) -> dict[str, Any]:
        db = request.app.state.db
        used = await run_in_threadpool(jobdb.usage_by_key, db)
        rows = await run_in_threadpool(jobdb.list_keys, db)
        env = [{"id": env_key_id(hash_key(k)), "name": "COHORT_API_KEYS", "prefix": None, "created": None,
                "revoked": None, "rpm": None, "tpm": None,
                "usage": used.get(env_key_id(hash_key(k)), {"requests": 0, "prompt_tokens": 0, "completion_tokens": 0})}
               for k in configured_keys(settings.api_keys)]
        return {"object": "list", "data": env + [_shown(r, used) for r in rows]}

    @router.delete("/{key_id}")
    async def revoke(key_id: str, request: Request) -> dict[str, Any]:
        st = request.app.state
        if not await run_in_threadpool(jobdb.revoke_key, st.db, key_id):
            raise APIError(404, f"no active key {key_id!r} (keys from COHORT_API_KEYS are revoked by removing them)",
                           code="key_not_found", param="key_id")
        await run_in_threadpool(st.keys.refresh, st.db)
        return {"id": key_id, "revoked": True}

    return router
