"""The gateway app factory: REST in front, the predictor in-process, Redis behind."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from cohort import bus
from cohort.jobdb import jobs_engine
from cohort.settings import Settings, get_settings
from cohort.tokenizer import prompt_token_counts
from gateway import openapi as openapi_doc
from gateway.admin import make_admin_router
from gateway.auth import ApiKeys, KeyBook, KeyMetrics
from gateway.batch_metrics import BatchJobs
from gateway.errors import RequestIds, install_error_handlers
from gateway.metrics import CountRequests, GatewayMetrics
from gateway.stream_hub import close_hub
from gateway.submit import PoolView
from gateway.validation import BodyLimit
from gateway.views import batches, files, generate, health, models, openai
from gateway.views.keys import make_keys_router
from predictor.service import PredictorService
from taskq.celery_app import enqueue_retrain, task_status

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
        reloader = asyncio.create_task(_reload_loop(st.predictor))
        log.info("gateway ready: policy=%s predictor=%s version=%s", s.policy, s.predictor_kind,
                 st.predictor.version)
        yield
        reloader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reloader
        st.predictor.close()
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


async def _reload_loop(predictor) -> None:
    """Swap in a new predictor version when the registry's ACTIVE pointer changes."""
    while True:
        await asyncio.sleep(1.0)
        try:
            await run_in_threadpool(predictor.maybe_reload)
        except Exception:
            log.exception("predictor reload failed; keeping the current version")
