"""The batcher's idle wait ends as soon as a producer sends it something (``bus.wake_batcher`` beside
every message it reads), and lasts its tick otherwise; the token list never grows past one."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import fakeredis
import fakeredis.aioredis

from cohort import bus
from cohort.protocol import BatchOutcome, CompletionEvent
from workers.reporting import admitted_fill, completion_fill


def test_the_wait_lasts_its_tick_when_nothing_arrives():
    r = fakeredis.FakeRedis(decode_responses=True)
    t0 = time.monotonic()
    assert bus.wait_for_work(r, "p", 0.05) is False
    assert time.monotonic() - t0 >= 0.04


def test_many_wakes_end_one_wait_and_leave_no_backlog():
    r = fakeredis.FakeRedis(decode_responses=True)
    for _ in range(50):
        pipe = r.pipeline()
        bus.wake_batcher(pipe, "p")
        pipe.execute()
    assert r.llen(bus.pool_keys("p").wake) == 1
    t0 = time.monotonic()
    assert bus.wait_for_work(r, "p", 5.0) is True
    assert time.monotonic() - t0 < 1.0
    assert bus.wait_for_work(r, "p", 0.01) is False
    assert bus.wait_for_work(r, "other", 0.01) is False  # pools do not wake each other


def test_every_producer_wakes_the_batcher():
    server = fakeredis.FakeServer()
    r = fakeredis.FakeRedis(server=server, decode_responses=True)
    ar = fakeredis.aioredis.FakeRedis(server=server, decode_responses=True)

    asyncio.run(bus.enqueue(ar, "p", ["r1"], ['{"id": "r1"}']))   # the gateway's arrival
    assert bus.wait_for_work(r, "p", 0.01) and r.llen(bus.pool_keys("p").incoming) == 1

    pipe = r.pipeline()
    bus.cancel(pipe, "r1", "p")                                        # a client that left
    pipe.execute()
    assert bus.wait_for_work(r, "p", 0.01)

    rt = SimpleNamespace(settings=SimpleNamespace(pool="p", visibility_timeout_s=60), name="w1")
    for fill in (admitted_fill(rt, "b1"), completion_fill(rt, CompletionEvent(batch_id="b1", outcome=BatchOutcome.DONE))):
        pipe = r.pipeline()
        fill(pipe)
        pipe.execute()
        assert bus.wait_for_work(r, "p", 0.01)
        assert not bus.wait_for_work(r, "p", 0.01)
