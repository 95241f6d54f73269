"""The gateway app factory: REST in front, the predictor in-process, Redis behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from cohort import bus
from cohort.heap import freeze_startup_heap
from cohort.jobdb import jobs_engine
from cohort.settings import Settings, get_settings
from cohort.tokenizer import prompt_token_counts
from gateway import openapi as openapi_doc
from gateway.admin import make_admin_router
from gateway.auth import ApiKeys, KeyBook, KeyMetrics
from gateway.batch_metrics import BatchJobs
from gateway.errors import RequestIds, install_error_handlers
from gateway.metrics import CountRequests, GatewayMetrics
from gateway.stream_hub import close_hub, hub_for
from gateway.submit import PoolView
from gateway.validation import BodyLimit
from gateway.views import batches, files, generate, health, models, openai
from gateway.views.keys import make_keys_router
from predictor.service import PredictorService
from taskq.celery_app import enqueue_retrain, task_status
from upstream.direct import DirectStreams

log = logging.getLogger("cohort.gateway")


def create_app(settings: Settings | None = None) -> FastAPI:
    s = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        st = app.state
        st.redis = bus.connect_async(s.resolved_redis_url)
        st.pool = PoolView(s, st.redis)
        st.db = jobs_engine(s.database_url)  # the log DB, with the Batch API's tables
        await run_in_threadpool(st.keys.refresh, st.db)
        await run_in_threadpool(st.predictor.warmup)
        await run_in_threadpool(prompt_token_counts, ["warm up"], s.model)
        st.direct = await start_direct_streams(st) if s.upstream_streaming == "gateway" else None
        reloader = asyncio.create_task(_reload_loop(st.predictor))
        freeze_startup_heap()
        log.info("gateway ready: policy=%s predictor=%s version=%s", s.policy, s.predictor_kind,
                 st.predictor.version)
        yield
        reloader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reloader
        st.predictor.close()
        if st.direct is not None:
            await st.direct.aclose()
        await close_hub(st)
        await st.redis.aclose()

    app = FastAPI(title="cohort", version="0.1.0", lifespan=lifespan,
                  description="Static-batch LLM serving: length prediction, WMA batching, HRRN dispatch.")
    app.state.settings = s
    app.state.metrics = GatewayMetrics()
    app.state.predictor = PredictorService(s)  # cheap; the model loads in the lifespan (warmup)
    app.state.keys = KeyBook(s)
    app.state.key_metrics = KeyMetrics(app.state.metrics.registry)
    BatchJobs(app.state, app.state.metrics.registry)
    app.add_middleware(ApiKeys)  # inside BodyLimit: a body too large is refused before the key is looked up
    app.add_middleware(BodyLimit, max_chars=s.max_text_chars, large={"/v1/files": s.max_file_bytes})
    app.add_middleware(CountRequests, metrics=app.state.metrics)  # outside BodyLimit: 413s are counted
    app.add_middleware(RequestIds)  # added last: outermost, so every response carries the id
    install_error_handlers(app)
    for view in (generate, openai, models, health, files, batches):
        app.include_router(view.router)
    if s.admin_token:
        app.include_router(make_admin_router(s, app.state.predictor, enqueue_retrain, task_status))
        app.include_router(make_keys_router(s))
    else:
        log.warning("COHORT_ADMIN_TOKEN is not set: admin endpoints are disabled")
    openapi_doc.install(app)
    return app


async def start_direct_streams(st) -> DirectStreams:
    """This gateway's direct streams (COHORT_UPSTREAM_STREAMING=gateway): rows of upstream pools it
    streams from their engines itself, their events handed to its hub beside the Redis streams'."""
    s = st.settings
    direct = DirectStreams(st.redis, f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}",
                           lambda rid, events: hub_for(st).push_local(rid, events), flush_s=s.upstream_flush_s,
                           report_s=s.upstream_report_s, read_timeout_s=s.upstream_timeout_s,
                           api_key=s.upstream_api_key)
    await direct.start()
    log.info("direct streaming: this gateway (%s) streams its upstream rows from their engines", direct.gateway_id)
    return direct


async def _reload_loop(predictor) -> None:
    """Swap in a new predictor version when the registry's ACTIVE pointer changes."""
    while True:
        await asyncio.sleep(1.0)
        try:
            if await run_in_threadpool(predictor.maybe_reload):
                freeze_startup_heap(collect=False)  # the new version's objects live as long as it does
        except Exception:
            log.exception("predictor reload failed; keeping the current version")
