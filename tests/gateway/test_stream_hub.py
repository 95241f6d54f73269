"""The gateway's one reader of every answer stream (gateway.stream_hub), on fakeredis."""

from __future__ import annotations

import asyncio
import functools
import time
from types import SimpleNamespace

import pytest
from fakeredis import aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from cohort import bus
from gateway.stream_hub import StreamHub, close_hub, hub_for


def synchronous(scenario):
    """The scenario as a plain test: run on its own event loop."""

    @functools.wraps(scenario)
    def test() -> None:
        asyncio.run(scenario())

    return test


async def _add(redis, request_id: str, text: str) -> str:
    return await redis.xadd(bus.stream_key(request_id), {bus.STREAM_FIELD: text})


async def _texts(reader, n: int, timeout_s: float = 3.0) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < n and time.monotonic() < deadline:
        got += [fields[bus.STREAM_FIELD] for _id, fields in await reader.next(0.2)]
    return got


@synchronous
async def test_each_reader_gets_its_own_stream_in_order():
    redis = aioredis.FakeRedis(decode_responses=True)
    hub = StreamHub(redis, block_s=5.0)
    a, b = await hub.subscribe("a"), await hub.subscribe("b")
    for i in range(3):
        await _add(redis, "a", f"a{i}")
        await _add(redis, "b", f"b{i}")
    assert await _texts(a, 3) == ["a0", "a1", "a2"]
    assert await _texts(b, 3) == ["b0", "b1", "b2"]
    hub.unsubscribe(a)
    hub.unsubscribe(b)
    assert hub.readers == {}


@synchronous
async def test_a_reader_joining_a_blocked_read_is_not_kept_waiting():
    """The hub blocks up to 5 s on the first stream; a second reader's entry still arrives at once."""
    redis = aioredis.FakeRedis(decode_responses=True)
    hub = StreamHub(redis, block_s=5.0)
    first = await hub.subscribe("quiet")
    await asyncio.sleep(0.2)  # the hub's call is now blocked on the quiet stream
    await _add(redis, "late", "x")
    t0 = time.monotonic()
    late = await hub.subscribe("late")
    assert await _texts(late, 1) == ["x"]
    assert time.monotonic() - t0 < 2.0
    hub.unsubscribe(first)
    hub.unsubscribe(late)


@synchronous
@pytest.mark.slow  # 0.54 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
async def test_a_reader_that_does_not_wake_is_read_by_the_next_call_from_its_start():
    """A request whose tokens the gateway streams itself: no wake, its entries (failures) come with
    the next call, at most ``block_s`` later, none missed."""
    redis = aioredis.FakeRedis(decode_responses=True)
    hub = StreamHub(redis, block_s=0.5)
    first = await hub.subscribe("quiet")
    await asyncio.sleep(0.1)  # the hub's call is now blocked on the quiet stream
    await _add(redis, "local", "e1")
    local = await hub.subscribe("local", wake=False)
    assert await redis.exists(hub._wake_key) == 0  # nothing was sent to end the blocked call
    assert await local.next(0.1) == []  # the call under way does not read it
    await _add(redis, "local", "e2")
    assert await _texts(local, 2, timeout_s=2.0) == ["e1", "e2"]
    hub.unsubscribe(first)
    hub.unsubscribe(local)


@synchronous
async def test_two_readers_of_one_request_each_get_every_entry():
    redis = aioredis.FakeRedis(decode_responses=True)
    hub = StreamHub(redis, block_s=0.5)
    early = await hub.subscribe("r")
    await _add(redis, "r", "0")
    await _add(redis, "r", "1")
    assert await _texts(early, 2) == ["0", "1"]
    again = await hub.subscribe("r")  # a row sent again follows the same request from its start
    await _add(redis, "r", "2")
    assert await _texts(again, 3) == ["0", "1", "2"]
    assert await _texts(early, 1) == ["2"]
    hub.unsubscribe(early)
    hub.unsubscribe(again)


@synchronous
async def test_a_failed_read_reaches_every_reader():
    redis = aioredis.FakeRedis(decode_responses=True)

    async def gone(*_a, **_k):
        raise RedisConnectionError("redis went away")

    hub = StreamHub(redis, block_s=0.5)
    hub._reads.xread = gone  # the hub's blocking reads go through a connection of their own
    readers = [await hub.subscribe("a"), await hub.subscribe("b")]
    for reader in readers:
        with pytest.raises(RedisConnectionError):
            await reader.next(2.0)


@synchronous
async def test_a_reader_whose_wake_fails_is_not_left_behind():
    redis = aioredis.FakeRedis(decode_responses=True)
    hub = StreamHub(redis, block_s=5.0)
    first = await hub.subscribe("quiet")
    await asyncio.sleep(0.2)  # blocked: the next reader must wake the call

    def broken_pipeline(*_a, **_k):
        raise RedisConnectionError("redis went away")

    redis.pipeline = broken_pipeline
    with pytest.raises(RedisConnectionError):
        await hub.subscribe("late")
    assert list(hub.readers) == [bus.stream_key("quiet")]
    hub.unsubscribe(first)


@synchronous
@pytest.mark.slow  # 0.47 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
async def test_the_client_is_asked_whether_it_left_once_a_slice_not_once_an_event():
    from cohort.protocol import StreamEvent, StreamKind
    from gateway.stream import Withdrawn, read_events

    redis = aioredis.FakeRedis(decode_responses=True)
    hub = StreamHub(redis, block_s=0.2)
    asked: list[float] = []
    gone = False

    async def disconnected() -> bool:
        asked.append(time.monotonic())
        return gone

    async def produce() -> None:  # a token stream: 20 deltas 20 ms apart (each its own read), then its end
        for i in range(1, 21):
            await asyncio.sleep(0.02)
            await redis.xadd(bus.stream_key("r"), {bus.STREAM_FIELD: StreamEvent.delta("x", i, [i]).to_json()})
        await redis.xadd(bus.stream_key("r"), {bus.STREAM_FIELD: StreamEvent(StreamKind.END, text="x" * 20,
                                                                             tokens=20).to_json()})

    producer = asyncio.create_task(produce())
    events = [ev async for ev in read_events(hub, "r", time.monotonic() + 30, 5.0, disconnected)]
    await producer
    assert len(events) == 21 and events[-1].final
    assert len(asked) == 1  # at the start only: the 21 events came within one 5 s slice

    gone, asked = True, []  # a waiting request whose client left is still noticed within a slice
    t0 = time.monotonic()
    with pytest.raises(Withdrawn):
        async for _ in read_events(hub, "silent", time.monotonic() + 30, 0.2, disconnected):
            pass
    assert len(asked) == 1 and time.monotonic() - t0 < 1.0


@synchronous
@pytest.mark.slow  # 0.61 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
async def test_a_replaced_hub_serves_its_readers_then_gives_its_connection_back():
    first, second = aioredis.FakeRedis(decode_responses=True), aioredis.FakeRedis(decode_responses=True)
    state = SimpleNamespace(redis=first, settings=SimpleNamespace(disconnect_check_s=0.2))
    hub = hub_for(state)
    reader = await hub.subscribe("a")
    await asyncio.sleep(0.1)  # blocked in its read, on its own connection
    assert len(first.connection_pool._in_use_connections) == 1
    state.redis = second  # the app's client changed: a new hub; the old one retires
    newer = hub_for(state)
    assert newer is not hub and hub_for(state) is newer
    await _add(first, "a", "still mine")
    assert await _texts(reader, 1) == ["still mine"]  # its reader is still served
    hub.unsubscribe(reader)
    await asyncio.sleep(0.5)  # its read ends (0.2 s block), and with no reader left it lets go
    assert hub._task.done() and len(first.connection_pool._in_use_connections) == 0


@synchronous
async def test_at_shutdown_the_hub_fails_its_waiting_readers_and_gives_its_connection_back():
    redis = aioredis.FakeRedis(decode_responses=True)
    state = SimpleNamespace(redis=redis, settings=SimpleNamespace(disconnect_check_s=5.0))
    hub = hub_for(state)
    reader = await hub.subscribe("a")
    await asyncio.sleep(0.1)
    assert len(redis.connection_pool._in_use_connections) == 1
    await close_hub(state)
    assert hub._task.done() and len(redis.connection_pool._in_use_connections) == 0
    with pytest.raises(ConnectionError, match="shutting down"):
        await reader.next(1.0)


@synchronous
async def test_a_retired_hub_whose_read_failed_gives_its_connection_back_with_its_last_reader():
    redis = aioredis.FakeRedis(decode_responses=True)
    closed: list[bool] = []

    async def gone(*_a, **_k):
        raise RedisConnectionError("redis went away")

    async def aclose(close_connection_pool=None):
        closed.append(close_connection_pool)

    hub = StreamHub(redis, block_s=0.5)
    hub._reads.xread, hub._reads.aclose = gone, aclose
    readers = [await hub.subscribe("a"), await hub.subscribe("b")]
    hub.retire()  # replaced while its read is under way
    for reader in readers:
        with pytest.raises(RedisConnectionError):
            await reader.next(2.0)
    assert hub._task.done() and closed == []  # failed, but its readers still hold it
    hub.unsubscribe(readers[0])
    await asyncio.sleep(0)
    assert closed == []
    hub.unsubscribe(readers[1])
    await asyncio.sleep(0.05)
    assert closed == [False]  # given back, the app's pool left open
