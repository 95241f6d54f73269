"""Per-process worker state: the loaded engine (or, for an upstream instance, the server it feeds:
``workers.upstream_start``), the Redis client, the log DB, and the instance's registration +
heartbeat (the batcher counts idle instances from these)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import redis

from batcher.prefix_pages import encode_summary
from cohort import bus
from cohort.logdb import get_db_engine
from cohort.protocol import dumps
from cohort.settings import Settings
from cohort.types import InstanceInfo
from predictor.learning import profile_samples_path
from workers.continuous_loop import ContinuousLoop
from workers.group_publisher import GroupPublisher
from workers.profile import run_profile

if TYPE_CHECKING:  # the model side (torch, transformers) loads only where a model does: an upstream
    from workers.engine import LLMEngine  # worker runs none, and starts without it

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    settings: Settings
    engine: LLMEngine  # an upstream instance's has only ``request_prompt_ids`` (UpstreamPrompts)
    redis: redis.Redis
    db: object
    info: InstanceInfo
    loop: ContinuousLoop | None = None  # continuous execution on the packed path (or an UpstreamLoop)
    publisher: GroupPublisher | None = None  # ... and the one thread that reports for its groups
    # what to advertise now: None withdraws the instance (an upstream whose server is down)
    status: Callable[[], InstanceInfo | None] | None = None
    # the page keys its KV pool holds, published for prefix-aware routing (None: it publishes none)
    prefix_summary: Callable[[], list[int]] | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    @property
    def name(self) -> str:
        return self.info.name

    def heartbeat_once(self) -> None:
        if self.status is not None:
            info = self.status()
            if info is None:
                self.redis.hdel(bus.INSTANCES, self.name)
                self.redis.delete(bus.alive_key(self.name))
                return
            self.info = info
        pipe = self.redis.pipeline()
        pipe.hset(bus.INSTANCES, self.name, dumps(self.info.to_dict()))
        ttl = max(1, int(self.settings.instance_ttl_s))
        pipe.set(bus.alive_key(self.name), str(time.time()), ex=ttl)
        if self.prefix_summary is not None:
            pipe.set(bus.prefix_summary_key(self.name), encode_summary(self.prefix_summary()), ex=ttl)
        pipe.execute()

    def _beat(self) -> None:
        period = max(0.5, self.settings.instance_ttl_s / 3)
        while not self._stop.wait(period):
            try:
                self.heartbeat_once()
            except redis.RedisError as e:  # keep beating; the batcher tolerates a gap < TTL
                log.warning("heartbeat failed: %s", e)

    def start_heartbeat(self) -> None:
        self.heartbeat_once()
        threading.Thread(target=self._beat, name="heartbeat", daemon=True).start()

    def deregister(self) -> None:
        self._stop.set()
        try:
            self.redis.hdel(bus.INSTANCES, self.name)
            self.redis.delete(bus.alive_key(self.name), bus.prefix_summary_key(self.name))
        except redis.RedisError:
            pass


_runtime: Runtime | None = None

# A short grid: enough for the analytic cold-start batch-time model, seconds on the built-in model.
START_PROFILE_GRID = [(b, L, G) for b in (1, 8) for L in (32, 256) for G in (16, 64)]


def profile_if_missing(engine: LLMEngine, settings: Settings) -> None:
    """Before registering, time a few batch shapes when no profile exists yet (cold start)."""
    path = profile_samples_path(settings)
    if path.exists():
        return
    grid = [shape for shape in START_PROFILE_GRID if engine.fits(*shape)]
    log.info("no batch-time profile yet: timing %d batch shapes for the cold-start estimator", len(grid))
    if grid:
        run_profile(engine, grid, path, show_progress=False)


def continuous_loop(engine: LLMEngine, settings: Settings) -> ContinuousLoop | None:
    """The continuous engine's loop, when continuous execution is asked for and the model can take
    the packed path; otherwise the instance runs batches on the padded path (named in the log)."""
    if settings.execution != "continuous":
        return None
    from workers.paged_executor import packed_path_refusal  # torch: see TYPE_CHECKING above

    refusal = packed_path_refusal(engine.model)
    if refusal is not None:
        log.warning("continuous execution asked for, but %s: this instance runs each batch on the padded "
                    "elastic path instead", refusal)
        return None
    loop = ContinuousLoop(engine.continuous_run)
    log.info("continuous execution: %d KV pages of %d tokens, %d tokens per step", loop.run.book.pool.num_pages,
             settings.continuous.page_tokens, settings.continuous.step_token_budget)
    return loop


def start(settings: Settings) -> Runtime:
    """Load the model, register the instance and start its heartbeat (once per process)."""
    global _runtime
    if _runtime is None:
        from workers.engine import LLMEngine  # torch: see TYPE_CHECKING above

        engine = LLMEngine(settings)
        if settings.profile_on_start:
            profile_if_missing(engine, settings)
        name = settings.instance_name or f"{socket.gethostname()}-{os.getpid()}"
        info = InstanceInfo(name=name, pool=settings.pool, model=settings.model,
                            theta_bytes=engine.theta_bytes, delta_bytes=engine.delta_bytes,
                            device=str(engine.device), started=time.time(),
                            served_model_name=settings.served_model_name or settings.model,
                            max_model_len=engine.max_model_len)
        rt = Runtime(settings, engine, bus.connect(settings.resolved_redis_url),
                     get_db_engine(settings.database_url), info)
        rt.loop = continuous_loop(engine, settings)
        if rt.loop is not None:
            rt.publisher = GroupPublisher(rt, rt.loop)
            pool, limit = rt.loop.run.book.pool, settings.prefix_summary_pages
            if settings.prefix_caching and settings.prefix_routing and limit:
                rt.prefix_summary = lambda: pool.summary(limit)
        rt.start_heartbeat()
        log.info("instance %s registered in pool %s: Θ=%d bytes, Δ=%d bytes/token", name, settings.pool,
                 info.theta_bytes, info.delta_bytes)
        _runtime = rt
    return _runtime


def set_current(rt: Runtime) -> Runtime:
    """Make ``rt`` this process's runtime (an upstream instance's, built by ``workers.upstream_start``)."""
    global _runtime
    _runtime = rt
    return rt


def get() -> Runtime:
    if _runtime is None:
        raise RuntimeError("worker runtime not started: run tasks through `cohort worker`")
    return _runtime
