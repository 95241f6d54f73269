"""The upstream worker's side of direct streaming, against a scripted server and a stand-in link:
an owned row is released (not streamed here) with its body; its gateway's reports give it its ids
and its end (answered without a stream event of its own); a broken stream hands it back from the
ids reported; a row nothing is heard of, or whose gateway died, does not hang; releases reach their
gateway in order while Redis is slow."""

from __future__ import annotations

import asyncio
import time
from functools import partial
from types import SimpleNamespace

import fakeredis
import pytest
from sqlalchemy import select

from cohort import bus
from cohort.logdb import get_db_engine, record_requests, requests
from cohort.protocol import FailureCode, FinishReason, Release, ReportKind, StreamReport
from cohort.release_bus import gateway_inbox
from cohort.settings import Settings
from cohort.tokenizer import load_tokenizer
from cohort.types import Batch, ProfiledRequest
from tests.redis_stalls import FirstPushWaits
from tests.upstream.test_admission import ScriptedServer
from upstream import release as upstream_release
from upstream.admission import UpstreamLoop
from workers.continuous_loop import GroupUpdate
from workers.group_publisher import GroupPublisher
from workers.reporting import queue_admission_marks
from workers.step_outputs import RowResult, StepOutput


class Server(ScriptedServer):
    base_url = "http://engine/v1"
    timeout_s = 0.2

    def payload(self, body):
        return {**body, "stream": True}


class Link:
    """Stands in for the Redis side: records releases; ``gone`` gateways are dead."""

    instance = "inst"

    def __init__(self, gone: set[str] = frozenset(), carries_admissions: bool = False) -> None:
        self.sent: list = []
        self.gone = set(gone)
        self.carries_admissions, self.admitted = carries_admissions, []

    def mark_admitted(self, batch_id: str) -> bool:
        if self.carries_admissions:
            self.admitted.append(batch_id)
        return self.carries_admissions

    async def start(self, on_reports) -> None:
        self.on_reports = on_reports

    def send(self, owner, rel) -> None:
        self.sent.append((owner, rel))
        self.sent_at = time.time()

    async def dead(self, owners):
        return owners & self.gone


def _req(rid: str, n: int, owner: str | None = "gw") -> ProfiledRequest:
    return ProfiledRequest(id=rid, prompt="hi", input_tokens=3, predicted_tokens=n, max_tokens=n, arrival=time.time(),
                           owner=owner)


def _loop(link: Link, poll_s: float = 60) -> UpstreamLoop:
    return UpstreamLoop(Server(), load_tokenizer(), capacity_tokens=4000, page_tokens=16, poll_s=poll_s, link=link)


def _updates(loop: UpstreamLoop, until, timeout_s: float = 10.0) -> list:
    out, deadline = [], time.time() + timeout_s
    while time.time() < deadline and not until(out):
        out += [u for _, u in loop.updates(0.1)]
    return out


def _report(loop: UpstreamLoop, *reports: StreamReport) -> None:
    loop._aloop.call_soon_threadsafe(loop.link.on_reports, list(reports))


def test_an_owned_row_is_released_and_its_gateways_reports_answer_it():
    link = Link()
    loop = _loop(link)
    try:
        loop.submit(Batch("b1", [_req("r1", 5), _req("plain", 3, owner=None)], time.time()), [[1, 2, 3], [1, 2, 3]])
        deadline = time.time() + 5
        while time.time() < deadline and not link.sent:
            time.sleep(0.01)
        (owner, rel), = link.sent
        assert owner == "gw" and rel.request_id == "r1" and rel.url == "http://engine/v1" and rel.instance == "inst"
        assert rel.payload["prompt"] == [1, 2, 3] and rel.payload["stream"] and rel.limit == 5
        assert [b["id"] for b in loop.server.bodies] == ["plain"]  # the other row streams here
        _report(loop, StreamReport("r1", ReportKind.PROGRESS, ids=[7, 8]),
                StreamReport("r1", ReportKind.FINISH, ids=[9, 10, 11], finish_reason="length", first_token_at=1.0))
        ups = _updates(loop, lambda out: any(u.done for u in out))
        finished = {res.request.id: res for u in ups for res in u.out.finished}
        assert finished["r1"].tokens == 5 and finished["r1"].finish_reason is FinishReason.LENGTH
        assert not finished["r1"].relayed and finished["plain"].relayed
    finally:
        loop.stop()


def test_a_broken_stream_hands_the_row_back_from_the_ids_reported():
    link = Link()
    loop = _loop(link)
    try:
        loop.submit(Batch("b1", [_req("r1", 10)], time.time()), [[1, 2, 3]])
        deadline = time.time() + 5
        while time.time() < deadline and not link.sent:
            time.sleep(0.01)
        _report(loop, StreamReport("r1", ReportKind.BROKEN, ids=[7, 8, 9], error="reset"))
        ups = _updates(loop, lambda out: any(u.done for u in out))
        (cont,) = [c for u in ups for c in u.out.evicted]
        assert cont.generated_ids == [7, 8, 9] and cont.max_tokens == 7 and cont.owner == "gw"
    finally:
        loop.stop()


def _one_row_until_done(link: Link, server_timeout_s: float | None = None) -> list:
    loop = _loop(link, poll_s=0.1)
    try:
        if server_timeout_s is not None:
            loop.server.timeout_s = server_timeout_s
        loop.submit(Batch("b1", [_req("r1", 10)], time.time()), [[1, 2, 3]])
        return _updates(loop, lambda out: any(u.done for u in out))
    finally:
        loop.stop()


@pytest.mark.slow  # 0.33 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_row_never_heard_of_continues_elsewhere(monkeypatch):
    monkeypatch.setattr(upstream_release, "SILENCE_MARGIN_S", 0.3)  # its release was lost: no report comes
    ups = _one_row_until_done(Link(), server_timeout_s=0.0)
    assert [c.id for u in ups for c in u.out.evicted] == ["r1"]


def test_a_row_whose_gateway_died_fails():
    ups = _one_row_until_done(Link(gone={"gw"}))
    (failed,) = [f for u in ups for f in u.out.failed]
    assert failed[0].id == "r1" and failed[1] is FailureCode.BATCH_FAILED and "gateway" in failed[2]


@pytest.mark.slow  # 0.72 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_releases_reach_their_gateway_in_order_while_a_push_waits_for_redis():
    # a gateway that took a row's first release after its continuation would run the stale one
    def rel(rid: str, done: int) -> Release:
        return Release(rid, "inst", "http://engine/v1", {"prompt": [1]}, done_tokens=done, limit=8, max_tokens=8)

    async def scenario() -> list[tuple[str, int]]:
        redis = fakeredis.aioredis.FakeRedis(decode_responses=True)
        link = upstream_release.ReleaseLink("redis://unused", "inst")
        link.redis = FirstPushWaits(redis, delay_s=0.3)
        link.send("gw", rel("r1", 0))
        await asyncio.sleep(0.1)  # its push waits for Redis
        link.send("gw", rel("r1", 5))
        link.send("gw", rel("r2", 0))
        await asyncio.sleep(0.6)
        listed = await redis.lrange(gateway_inbox("gw"), 0, -1)
        return [(r.request_id, r.done_tokens) for r in map(Release.from_json, listed)]

    assert asyncio.run(scenario()) == [("r1", 0), ("r1", 5), ("r2", 0)]


def test_a_rows_queue_time_ends_at_its_admission_not_at_the_flush_that_tells_of_it(tmp_path):
    """The worker tells of an admission with its next flush (``flush_s`` later); the log DB's queue
    time of the rows still ends when they joined the engine's rows (released to their gateway)."""
    link = Link()
    loop = UpstreamLoop(Server(), load_tokenizer(), capacity_tokens=4000, page_tokens=16, poll_s=60, link=link,
                        flush_s=0.4)
    try:
        req = _req("r1", 5)
        loop.submit(Batch("b1", [req], time.time()), [[1, 2, 3]])
        upd = next(u for u in _updates(loop, lambda out: any(u.admitted for u in out)) if u.admitted)
        told = time.time()
    finally:
        loop.stop()
    assert abs(upd.admitted_at - link.sent_at) < 0.05 and told - upd.admitted_at > 0.3

    rt = SimpleNamespace(redis=fakeredis.FakeRedis(decode_responses=True), name="inst", settings=Settings(),
                         db=get_db_engine(f"sqlite:///{tmp_path}/log.db"))
    record_requests(rt.db, [{"id": req.id}])
    engine = SimpleNamespace(submit=lambda b, ids: None, updates=lambda wait_s: time.sleep(wait_s) or [],
                             counters=dict, cancel=lambda ids: None)
    pub = GroupPublisher(rt, engine)
    try:
        pub.submit(Batch("b1", [req], time.time()), [[1, 2, 3]])
        handle = SimpleNamespace(batch_id="b1")
        pub._publish([(handle, GroupUpdate(admitted=True, admitted_at=upd.admitted_at))])
        out = StepOutput(finished=[RowResult(req, "", 5, FinishReason.LENGTH, upd.admitted_at + 0.01, time.time(),
                                             relayed=False)])
        pub._publish([(handle, GroupUpdate(out=out, done=True))])
    finally:
        pub.stop()
    with rt.db.connect() as conn:
        row = conn.execute(select(requests).where(requests.c.id == req.id)).one()
    assert row.status == "done" and row.queued_s == pytest.approx(upd.admitted_at - req.arrival, abs=1e-3)


def test_a_group_whose_rows_all_went_to_gateways_is_told_admitted_with_their_releases():
    """Its admission goes to the batcher with the releases (no round of the publisher for that news
    alone); the publisher still learns when it was admitted (its rows' queue time) at its end. A
    group with a row streamed here is told by the publisher, as before."""
    link = Link(carries_admissions=True)
    loop = _loop(link)
    got: dict[str, list] = {"b1": [], "b2": []}

    def collect(until) -> None:
        deadline = time.time() + 5
        while time.time() < deadline and not until():
            for h, u in loop.updates(0.1):
                got[h.batch_id].append(u)

    try:
        loop.submit(Batch("b1", [_req("r1", 5), _req("r2", 5)], time.time()), [[1, 2, 3], [1, 2, 3]])
        loop.submit(Batch("b2", [_req("r3", 5), _req("plain", 3, owner=None)], time.time()), [[1, 2, 3], [4, 5]])
        collect(lambda: len(link.sent) == 3 and any(u.admitted for u in got["b2"]))
        assert link.admitted == ["b1"]
        _report(loop, *(StreamReport(r, ReportKind.FINISH, ids=[7, 8], finish_reason="stop") for r in ("r1", "r2", "r3")))
        collect(lambda: all(us and us[-1].done for us in got.values()))
    finally:
        loop.stop()
    assert not any(u.admitted for u in got["b1"]) and got["b1"][-1].done and got["b1"][-1].admitted_at is not None
    assert any(u.admitted for u in got["b2"]) and got["b2"][-1].done  # its plain row streams here: the publisher tells


def test_the_link_sends_admissions_with_its_releases():
    """The real link, on an asyncio Redis: the release and the admission marker go in one push,
    and a batcher waiting for room is woken (``batcher_hunger``)."""
    settings = Settings()
    keys = bus.pool_keys(settings.pool)

    async def scenario() -> tuple:
        redis = fakeredis.aioredis.FakeRedis(decode_responses=True)
        link = upstream_release.ReleaseLink("redis://unused", "inst",
                                            admitted=partial(queue_admission_marks, settings=settings, instance="inst"))
        link.redis = redis
        await redis.set(keys.hungry, 1)
        link.send("gw", Release("r1", "inst", "http://engine/v1", {"prompt": [1]}, limit=8, max_tokens=8))
        assert link.mark_admitted("b1")
        await asyncio.sleep(0.05)
        return (await redis.get(bus.admitted_key("b1")), await redis.llen(gateway_inbox("gw")),
                await redis.llen(keys.wake))

    assert asyncio.run(scenario()) == ("inst", 1, 1)
    assert not upstream_release.ReleaseLink("redis://unused", "inst").mark_admitted("b1")  # the publisher tells
