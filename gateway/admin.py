"""The /admin router: retraining on demand, model versions (list, activate = rollback), the
active policy and the queue state.

Mounted by the app factory only when ``COHORT_ADMIN_TOKEN`` is set; one router-level dependency
checks ``Authorization: Bearer <token>`` for every route. Retraining never runs in the gateway:
``POST /admin/retrain`` enqueues the Celery learning task (the learning worker runs it off the
request path) and answers 202 with the task id; ``GET /admin/tasks/{id}`` reports its state. The
gateway's reload loop swaps a newly activated predictor in within a second.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool

from cohort import bus
from cohort.settings import Settings
from gateway import openapi as openapi_doc
from gateway.errors import APIError
from predictor.registry import Registry

log = logging.getLogger("cohort.gateway.admin")

POLICY_SETTINGS = ("policy", "execution", "oom_recovery", "wma_threshold", "memory_headroom", "fixed_batch_size",
                   "max_requeues", "max_preemptions", "instance_ttl_s", "max_pending", "max_input_tokens",
                   "max_tokens_limit", "pool", "predictor_kind", "cold_start", "emulate_lengths",
                   "visibility_timeout_s")

Target = Literal["predictor", "estimator"]
Enqueue = Callable[[str], str]                 # target -> task id
TaskStatus = Callable[[str], dict[str, Any]]   # task id -> {"state", "result"?, "error"?}


class RetrainBody(BaseModel):
    target: Target


def bearer_check(token: str) -> Callable[[Request], None]:
    """The router's dependency: a constant-time compare of the bearer token, else 401. Compared
    as bytes: a header arrives decoded as Latin-1 and may hold any byte, which ``compare_digest``
    refuses in a str (TypeError: a 500) but compares fine as bytes."""
    expected = token.encode()

    def check(request: Request) -> None:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if not token or scheme.lower() != "bearer" or not secrets.compare_digest(
                given.strip().encode("latin-1", "replace"), expected):
            raise APIError(401, "invalid or missing admin token (Authorization: Bearer <COHORT_ADMIN_TOKEN>)",
                           code="invalid_api_key")

    return check


def make_admin_router(settings: Settings, predictor_service: Any, enqueue: Enqueue,
                      task_status: TaskStatus) -> APIRouter:
    """``enqueue(target)`` sends the learning task and returns its id (taskq.celery_app); the
    predictor service gives the version in use and swaps on activation."""
    router = APIRouter(prefix="/admin", tags=["admin"], dependencies=[Depends(bearer_check(settings.admin_token))])

    @router.get("/openapi.json", include_in_schema=False)
    async def admin_openapi(request: Request) -> dict[str, Any]:
        """The whole document, admin routes included (the public /openapi.json leaves them out)."""
        return openapi_doc.build(request.app, include_admin=True)

    @router.post("/retrain", status_code=202)
    async def retrain(body: RetrainBody) -> dict[str, Any]:
        task_id = await run_in_threadpool(enqueue, body.target)
        log.info("admin: retraining of the %s enqueued as task %s", body.target, task_id)
        return {"target": body.target, "task_id": task_id, "status": "queued"}

    @router.get("/tasks/{task_id}")
    async def task(task_id: str) -> dict[str, Any]:
        return {"task_id": task_id, **await run_in_threadpool(task_status, task_id)}

    @router.get("/models")
    async def models() -> dict[str, Any]:
        pred = Registry(settings.data_dir, "predictor").listing()
        pred["in_use"] = predictor_service.version
        return {"predictor": pred, "estimator": Registry(settings.data_dir, "estimator").listing()}

    @router.post("/models/{version}/activate")
    async def activate(version: str) -> dict[str, Any]:
        for target in ("predictor", "estimator"):
            reg = Registry(settings.data_dir, target)
            if reg.exists(version):
                reg.activate(version)
                if target == "predictor":  # the batcher's estimator reloads on its own lock beat
                    await run_in_threadpool(predictor_service.maybe_reload, True)
                log.info("admin: %s version %s activated", target, version)
                return {"target": target, "active": version}
        raise APIError(404, f"no model version {version!r}", code="version_not_found", param="version")

    @router.get("/policy")
    async def policy(request: Request) -> dict[str, Any]:
        st = request.app.state
        alive = await st.pool.alive()
        return {"policy": settings.policy, "settings": {k: getattr(settings, k) for k in POLICY_SETTINGS},
                "instances": [i.to_dict() for i in alive], "predictor_version": predictor_service.version}

    @router.get("/queue")
    async def queue(request: Request) -> JSONResponse:
        r, now, keys = request.app.state.redis, time.time(), bus.pool_keys(settings.pool)
        inflight = []
        for bid, js in (await r.hgetall(keys.inflight)).items():
            reqs = json.loads(js)["batch"]["requests"]
            inflight.append({"batch_id": bid, "size": len(reqs),
                             "dispatched_age_s": round(now - json.loads(js)["dispatched"], 3),
                             "input_len": max(q["input_tokens"] for q in reqs),
                             "predicted_gen_len": max(q["predicted_tokens"] for q in reqs),
                             "instance": await r.get(bus.claim_key(bid))})
        pending = [json.loads(v) for v in (await r.hvals(keys.pending))]
        oldest = min((p["arrival"] for p in pending), default=None)
        return JSONResponse({"incoming": await r.llen(keys.incoming), "pending": len(pending),
                             "oldest_pending_age_s": round(now - oldest, 3) if oldest else None,
                             "inflight": inflight,
                             "stats": {k: int(v) for k, v in (await r.hgetall(bus.STATS)).items()}})

    return router
