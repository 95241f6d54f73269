"""An upstream instance takes its groups off the Redis sets on its engine loop's thread: best first,
its own set before the pool's, each claimed before it is handed to admission; a group claimed
elsewhere, or already running here, is skipped; the next group waits for room."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import fakeredis

from cohort import bus
from cohort.release_bus import group_set, hand_over
from cohort.tokenizer import load_tokenizer
from cohort.types import Batch, ProfiledRequest
from tests.upstream.test_release import Link, Server
from upstream.admission import UpstreamLoop
from upstream.group_intake import GroupSource, Room, serve_groups


def _batch(name: str) -> Batch:
    return Batch(id=name, requests=[ProfiledRequest(id=f"{name}-q", prompt="p", input_tokens=4, predicted_tokens=4,
                                                    max_tokens=8, arrival=0.0, prompt_ids=[1, 2, 3])], created=0.0)


async def _hand_over(r, key: str, name: str, rank: float) -> None:
    pipe = r.pipeline()
    hand_over(pipe, key, 0, rank, json.dumps(_batch(name).to_dict()))
    await pipe.execute()


def _intake(r, stop: threading.Event, register=lambda b: True) -> GroupSource:
    return GroupSource(r, "default", "u1", 60.0, register, lambda req: list(req.prompt_ids), stop)


def test_the_instance_takes_its_own_groups_first_then_the_pools_best_first_each_claimed():
    async def scenario() -> tuple[list[str], list]:
        r = fakeredis.aioredis.FakeRedis(decode_responses=True)
        await _hand_over(r, group_set("default"), "pool-late", 30.0)
        await _hand_over(r, group_set("default"), "pool-early", 10.0)
        await _hand_over(r, group_set("default", "u1"), "own-b", 50.0)
        await _hand_over(r, group_set("default", "u1"), "own-a", 40.0)
        stop, taken = threading.Event(), []

        def take(b: Batch, ids: list[list[int]]) -> None:
            taken.append((b.id, ids))
            if len(taken) == 4:
                stop.set()

        async def room() -> None:
            return None

        await serve_groups(_intake(r, stop), take, room)
        claims = [await r.get(bus.claim_key(b)) for b, _ in taken]
        return [b for b, _ in taken], [taken[0][1], claims]

    order, (ids, claims) = asyncio.run(scenario())
    assert order == ["own-a", "own-b", "pool-early", "pool-late"]
    assert ids == [[1, 2, 3]] and claims == ["u1"] * 4


def test_a_group_claimed_elsewhere_or_running_here_is_skipped():
    async def scenario() -> list[str]:
        r = fakeredis.aioredis.FakeRedis(decode_responses=True)
        await r.set(bus.claim_key("theirs"), "u2")
        for i, name in enumerate(["theirs", "twice", "mine"]):
            await _hand_over(r, group_set("default"), name, float(i))
        stop, taken = threading.Event(), []
        intake = _intake(r, stop, register=lambda b: b.id != "twice")  # "twice" already runs here
        for _ in range(3):
            if (b := await intake.next_group()) is not None:
                taken.append(b.id)
        return taken

    assert asyncio.run(scenario()) == ["mine"]


def test_the_room_wakes_the_loops_intake_and_a_callers_thread():
    async def scenario() -> float:
        room = Room()
        room.clear()
        asyncio.get_running_loop().call_later(0.05, room.set)
        t0 = time.monotonic()
        await room.wait_async(5.0)
        return time.monotonic() - t0

    assert asyncio.run(scenario()) < 1.0
    room = Room()
    room.clear()
    assert not room.wait(0.01)


def test_the_engine_loop_admits_a_group_it_took_itself():
    """End to end on the loop's thread: popped, claimed, registered, admitted, released."""
    server = fakeredis.FakeServer()
    r = fakeredis.aioredis.FakeRedis(server=server, decode_responses=True)
    sync = fakeredis.FakeRedis(server=server, decode_responses=True)
    pipe = sync.pipeline()
    hand_over(pipe, group_set("default"), 0, 1.0, json.dumps(Batch("g1", [ProfiledRequest(
        id="r1", prompt="hi", input_tokens=3, predicted_tokens=5, max_tokens=5, arrival=time.time(), owner="gw",
        prompt_ids=[1, 2, 3])], time.time()).to_dict()))
    pipe.execute()
    link, registered, stop = Link(), [], threading.Event()
    loop = UpstreamLoop(Server(), load_tokenizer(), capacity_tokens=4000, page_tokens=16, poll_s=60, link=link)
    try:
        loop.start_intake(GroupSource(r, "default", "u1", 60.0, lambda b: registered.append(b.id) or True,
                                 lambda req: list(req.prompt_ids), stop))
        deadline = time.time() + 5
        while time.time() < deadline and not link.sent:
            time.sleep(0.01)
    finally:
        stop.set()
        loop.stop()
    assert registered == ["g1"] and [rel.request_id for _, rel in link.sent] == ["r1"]
    assert sync.get(bus.claim_key("g1")) == "u1"
