"""Admission is one Redis step: under any burst the queue never holds more than
COHORT_MAX_PENDING (incoming + pending + reserved), the rest get 429 + Retry-After and leave no
record; a more urgent request is admitted into a full queue (the batcher sheds the least
urgent); ``priority`` reaches the batcher on every endpoint."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import select

from cohort import bus
from cohort.logdb import requests
from tests.gateway.harness import MSG, gateway, next_request

KEYS = bus.pool_keys("default")


def _statuses(app) -> list[str]:
    with app.state.db.connect() as conn:
        return [r.status for r in conn.execute(select(requests.c.status))]


async def _depth(redis) -> int:
    return await redis.llen(KEYS.incoming) + await redis.hlen(KEYS.pending) + await redis.zcard(KEYS.reservations)


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_burst_never_exceeds_the_limit(tmp_path):
    """60 simultaneous requests, room for 10, nobody answering: exactly 10 admitted (they time
    out), 50 refused with 429 + Retry-After and no record."""
    async def scenario():
        async with gateway(tmp_path, max_pending=10, request_timeout_s=1.0) as (app, client, redis):
            peak = 0

            async def watch() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, await _depth(redis))
                    await asyncio.sleep(0.001)

            watcher = asyncio.create_task(watch())
            rs = await asyncio.gather(*[client.post("/v1/generate", json={"input": f"burst {i}", "max_tokens": 4})
                                        for i in range(60)])
            watcher.cancel()
            return app, rs, peak, await redis.llen(KEYS.incoming), await redis.zcard(KEYS.reservations)

    app, rs, peak, queued, reserved = asyncio.run(scenario())
    codes = sorted(r.status_code for r in rs)
    assert codes.count(504) == 10 and codes.count(429) == 50, codes
    refused = [r for r in rs if r.status_code == 429]
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert peak <= 10 and queued == 10 and reserved == 0
    assert sorted(_statuses(app)) == ["timeout"] * 10  # one record per accepted request, none for refusals


def test_more_urgent_request_enters_a_full_queue(tmp_path):
    async def scenario():
        async with gateway(tmp_path, max_pending=1, request_timeout_s=0.15) as (app, client, redis):
            first = asyncio.create_task(client.post("/v1/generate", json={"input": "a", "priority": 5}))
            deadline = time.monotonic() + 10.0  # its profiling may be slow on a busy CPU: wait until it is queued
            while await redis.llen(KEYS.incoming) < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await redis.set(KEYS.worst_priority, 5)  # what the batcher publishes once it has taken it
            same = await client.post("/v1/generate", json={"input": "b", "priority": 5})
            urgent = asyncio.create_task(client.post("/v1/chat/completions", json={"messages": MSG, "priority": -2}))
            await asyncio.gather(first, urgent)
            reqs = [await next_request(redis), await next_request(redis)]
            return same, urgent.result(), reqs

    same, urgent, reqs = asyncio.run(scenario())
    assert same.status_code == 429
    assert urgent.status_code == 504  # admitted over the limit (nobody answers here)
    assert [r.priority for r in reqs] == [5, -2]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/generate", {"input": "hi"}),
    ("/v1/completions", {"prompt": ["a", "b"], "n": 2}),
    ("/v1/chat/completions", {"messages": MSG}),
])
def test_priority_reaches_the_batcher(tmp_path, path, body):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.15) as (_, client, redis):
            task = asyncio.create_task(client.post(path, json={**body, "priority": 7}))
            await task
            out = []
            while js := await redis.rpop(KEYS.incoming):
                out.append(js)
            return out

    queued = asyncio.run(scenario())
    assert queued and all('"priority":7' in js for js in queued)


def test_stale_reservations_expire(tmp_path):
    """A gateway that died between reserving and enqueueing does not hold its slots for ever."""
    async def scenario():
        async with gateway(tmp_path, max_pending=2, request_timeout_s=0.15) as (_, client, redis):
            await redis.zadd(KEYS.reservations, {"req-dead-1": time.time() - 1, "req-dead-2": time.time() - 1})
            r = await client.post("/v1/generate", json={"input": "hi"})
            return r, await redis.zrange(KEYS.reservations, 0, -1)

    r, left = asyncio.run(scenario())
    assert r.status_code == 504 and left == []


def test_queue_unavailable_at_enqueue_fails_the_record_and_frees_the_slot(tmp_path, monkeypatch):
    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            async def down(*_a, **_k):
                raise RedisConnectionError("Connection refused")
            monkeypatch.setattr(bus, "enqueue", down)
            r = await client.post("/v1/generate", json={"input": "hi"})
            return app, r, await redis.zcard(KEYS.reservations)

    app, r, reserved = asyncio.run(scenario())
    assert r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] == "unavailable"
    assert "refused" not in r.json()["error"]["message"]  # no raw exception text
    assert reserved == 0 and _statuses(app) == ["failed"]
