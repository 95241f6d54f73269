"""Admin views of the scheduler: the active policy with its settings, and the queue state."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from cohort import bus
from gateway.auth import admin_denied

router = APIRouter(prefix="/admin", tags=["admin"])

POLICY_SETTINGS = ("policy", "wma_threshold", "fixed_batch_size", "max_requeues", "instance_ttl_s",
                   "max_pending", "max_input_tokens", "max_tokens_limit", "pool", "predictor_kind",
                   "cold_start", "emulate_lengths", "visibility_timeout_s")


@router.get("/policy")
async def policy(request: Request) -> JSONResponse:
    st = request.app.state
    if (denied := admin_denied(request, st.settings.admin_token)) is not None:
        return denied
    alive = await st.pool.alive()
    return JSONResponse({
        "policy": st.settings.policy,
        "settings": {k: getattr(st.settings, k) for k in POLICY_SETTINGS},
        "instances": [i.to_dict() for i in alive],
        "predictor_version": st.predictor.version,
    })


@router.get("/queue")
async def queue(request: Request) -> JSONResponse:
    st = request.app.state
    if (denied := admin_denied(request, st.settings.admin_token)) is not None:
        return denied
    r, now = st.redis, time.time()
    inflight = []
    for bid, js in (await r.hgetall(bus.INFLIGHT)).items():
        d = json.loads(js)
        reqs = d["batch"]["requests"]
        inflight.append({"batch_id": bid, "size": len(reqs), "dispatched_age_s": round(now - d["dispatched"], 3),
                         "input_len": max(q["input_tokens"] for q in reqs),
                         "predicted_gen_len": max(q["predicted_tokens"] for q in reqs),
                         "instance": await r.get(bus.claim_key(bid))})
    pending = [json.loads(v) for v in (await r.hvals(bus.PENDING))]
    oldest = min((p["arrival"] for p in pending), default=None)
    return JSONResponse({
        "incoming": await r.llen(bus.INCOMING),
        "pending": len(pending),
        "oldest_pending_age_s": round(now - oldest, 3) if oldest else None,
        "inflight": inflight,
        "stats": {k: int(v) for k, v in (await r.hgetall(bus.STATS)).items()},
    })
