"""Admin endpoints for model versions: retrain now, list versions, activate (rollback).

Mounted by the app factory only when ``COHORT_ADMIN_TOKEN`` is set. Every route checks
``Authorization: Bearer <token>`` itself (constant-time compare) and answers 401 with an
OpenAI-style error body otherwise, so the router behaves the same whichever error handlers the
app installs. Retraining runs in a worker thread: the event loop keeps serving completions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from cohort.settings import Settings
from gateway.auth import admin_denied
from gateway.errors import error_response
from predictor.registry import Registry

log = logging.getLogger("cohort.gateway.admin")

def make_admin_router(settings: Settings, predictor_service: Any,
                      estimator_reload_hook: Callable[[], Any] | None = None) -> APIRouter:
    """The /admin router. ``predictor_service`` needs ``maybe_reload(force=True)`` and ``version``;
    ``estimator_reload_hook`` (optional) is called after the estimator's ACTIVE version changes."""
    router = APIRouter(prefix="/admin", tags=["admin"])
    token = settings.admin_token or ""

    async def after_change(target: str) -> None:
        try:
            if target == "predictor" and predictor_service is not None:
                await run_in_threadpool(predictor_service.maybe_reload, True)
            elif target == "estimator" and estimator_reload_hook is not None:
                await run_in_threadpool(estimator_reload_hook)
        except Exception:  # the version is active on disk; reload loops will pick it up
            log.exception("reload after %s change failed", target)

    @router.post("/retrain")
    async def retrain(request: Request) -> JSONResponse:
        if (resp := admin_denied(request, token)) is not None:
            return resp
        try:
            body = await request.json()
        except ValueError:
            body = None
        target = body.get("target") if isinstance(body, dict) else None
        if target not in ("predictor", "estimator"):
            return error_response(400, 'body must be {"target": "predictor" | "estimator"}', code="invalid_value",
                          param="target")
        from predictor import learning

        fn = learning.retrain_predictor if target == "predictor" else learning.retrain_estimator
        try:
            out = await run_in_threadpool(fn, settings, True)
        except Exception as e:
            log.exception("retraining %s failed", target)
            return error_response(500, f"retraining {target} failed: {e}", code="retrain_failed")
        await after_change(target)
        return JSONResponse({"target": target, **out})

    @router.get("/models")
    async def models(request: Request) -> JSONResponse:
        if (resp := admin_denied(request, token)) is not None:
            return resp
        pred = Registry(settings.data_dir, "predictor").listing()
        pred["in_use"] = getattr(predictor_service, "version", None) if predictor_service is not None else None
        return JSONResponse({"predictor": pred, "estimator": Registry(settings.data_dir, "estimator").listing()})

    @router.post("/models/{version}/activate")
    async def activate(version: str, request: Request) -> JSONResponse:
        if (resp := admin_denied(request, token)) is not None:
            return resp
        for target in ("predictor", "estimator"):
            reg = Registry(settings.data_dir, target)
            if reg.exists(version):
                reg.activate(version)
                await after_change(target)
                log.info("admin: %s version %s activated", target, version)
                return JSONResponse({"target": target, "active": version})
        return error_response(404, f"no model version {version!r}", code="version_not_found", param="version")

    return router
