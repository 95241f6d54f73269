"""The batcher's idle wait ends as soon as a producer sends it something it must act on
(``bus.wake_batcher`` beside an arrival, a cancel, a completion that asks for work; an admission or a
plain end only while requests wait: ``cohort.batcher_hunger``), and lasts its tick otherwise; the
token list never grows past one."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import fakeredis
import fakeredis.aioredis

from cohort import batcher_hunger, bus
from cohort.protocol import BatchOutcome, CompletionEvent
from cohort.types import ProfiledRequest
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
    for ev in (CompletionEvent(batch_id="b1", outcome=BatchOutcome.FAILED, error="boom"),
               CompletionEvent(batch_id="b1", outcome=BatchOutcome.OOM),
               CompletionEvent(batch_id="b1", outcome=BatchOutcome.DONE, continuations=[ProfiledRequest("c", "p", 1, 1, 8, 0.0)])):
        _send(r, completion_fill(rt, ev))                          # a completion that asks for work
        assert bus.wait_for_work(r, "p", 0.01)
        assert not bus.wait_for_work(r, "p", 0.01)


def _send(r, fill) -> None:
    pipe = r.pipeline()
    fill(pipe)
    pipe.execute()


def test_admissions_and_plain_ends_wake_the_batcher_only_while_requests_wait():
    r = fakeredis.FakeRedis(decode_responses=True)
    rt = SimpleNamespace(settings=SimpleNamespace(pool="p", visibility_timeout_s=60), name="w1")
    plain = (admitted_fill(rt, "b1"), completion_fill(rt, CompletionEvent(batch_id="b1", outcome=BatchOutcome.DONE)))
    for fill in plain:
        _send(r, fill)
        assert not bus.wait_for_work(r, "p", 0.01)  # nothing waits: its next round reads them
    r.delete(bus.pool_keys("p").completions)
    assert batcher_hunger.announce(r, "p", True, ["b2"]) is False  # nothing came since its read
    for fill in plain:
        _send(r, fill)
        assert bus.wait_for_work(r, "p", 0.01)
    batcher_hunger.announce(r, "p", False, [])
    _send(r, plain[1])
    assert not bus.wait_for_work(r, "p", 0.01)
    assert r.ttl(bus.pool_keys("p").hungry) == -2


def test_an_end_or_admission_between_the_read_and_the_announcement_still_wakes_the_batcher():
    r = fakeredis.FakeRedis(decode_responses=True)
    rt = SimpleNamespace(settings=SimpleNamespace(pool="p", visibility_timeout_s=60), name="w1")
    _send(r, completion_fill(rt, CompletionEvent(batch_id="b1", outcome=BatchOutcome.DONE)))  # not hungry yet: no wake
    assert batcher_hunger.announce(r, "p", True, []) is True
    assert bus.wait_for_work(r, "p", 0.01)
    r.delete(bus.pool_keys("p").completions)  # the round took it
    _send(r, admitted_fill(rt, "b2"))  # woken: the key is there now
    assert bus.wait_for_work(r, "p", 0.01)
    r.delete(bus.pool_keys("p").hungry)
    _send(r, admitted_fill(rt, "b3"))  # lands while the batcher announces: b3 is one it waits for
    assert batcher_hunger.announce(r, "p", True, ["b3"]) is True
    assert bus.wait_for_work(r, "p", 0.01)
    assert 0 < r.ttl(bus.pool_keys("p").hungry) <= batcher_hunger.HUNGRY_TTL_S
