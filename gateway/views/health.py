"""/health (readiness: Redis reachable, the pool's batcher alive, an instance alive) and /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from cohort import bus

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    st = request.app.state
    try:
        await st.redis.ping()
        redis_ok = True
    except Exception:  # reported, not raised: health must always answer
        redis_ok = False
    alive = await st.pool.alive() if redis_ok else []
    # the batcher's lock expires 10 s after its last renewal: it is the batcher's heartbeat
    batcher = bool(redis_ok and await st.redis.exists(bus.pool_keys(st.settings.pool).batcher_lock))
    body = {"status": "ok" if redis_ok and alive and batcher else "unavailable", "redis": redis_ok,
            "batcher": batcher, "instances": [i.name for i in alive], "policy": st.settings.policy,
            "predictor_version": st.predictor.version}
    return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    st = request.app.state
    return Response(await st.metrics.render(st.redis, len(await st.pool.alive()), st.settings.pool), media_type=CONTENT_TYPE_LATEST)
