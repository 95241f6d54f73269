"""The gateway's side of direct streaming against a scripted engine on loopback and an in-memory
Redis: a release streams to the client's events, with progress and the end reported to the worker;
stop strings found across chunks and across a continuation's cut; a broken stream, a refusal and a
client that leaves each reported as such."""

from __future__ import annotations

import asyncio
import json

import fakeredis
import pytest
from aiohttp import web

from cohort.protocol import Release, ReportKind, StreamEvent, StreamKind, StreamReport
from cohort.release_bus import gateway_alive_key, gateway_inbox, instance_inbox
from tests.loopback import open_sse, serving
from tests.redis_stalls import FirstPushWaits
from upstream.direct import DirectStreams, stop_at

CLOSED = web.AppKey("closed", list)


def _engine(pieces: list[str], *, fail_after: int | None = None, status: int = 200, delay_s: float = 0.005,
            key: str | None = None):
    """A server streaming one chunk per piece (ids 100, 101, ...), then "length"; ``closed`` lists
    the requests whose client closed the stream; ``key``: 401 without it, as vLLM's --api-key."""
    closed: list[dict] = []
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        r = await open_sse(request, key=key, status=status)
        if r.status != 200:
            return r
        n = min(len(pieces), body["max_tokens"])
        for i, piece in enumerate(pieces[:n]):
            if fail_after is not None and i >= fail_after:
                request.transport.close()  # the connection breaks mid-stream
                return r
            await asyncio.sleep(delay_s)
            chunk = {"choices": [{"index": 0, "text": piece, "token_ids": [100 + i],
                                  "finish_reason": "length" if i == n - 1 else None}]}
            try:
                await r.write(f"data: {json.dumps(chunk)}\n\n".encode())
            except ConnectionError:  # the client closed its stream: the request is aborted
                closed.append(body)
                return r
        await r.write(b"data: [DONE]\n\n")
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app[CLOSED] = closed
    return app


def _release(url: str, rid: str = "r1", **kw) -> Release:
    return Release(rid, "inst", url, {"prompt": [1, 2], "max_tokens": kw.pop("max_tokens", 50), "stream": True},
                   limit=kw.pop("limit", 50), max_tokens=50, batch_id="b1", batch_size=1, arrival=1.0, started=2.0,
                   **kw)


async def _run(app: web.Application, releases, *, leave_after_s: float | None = None, settle_s: float = 0.4,
               wrap=lambda redis: redis, report_s: float = 0.25, until_finish: bool = False, api_key: str | None = None):
    """Serve ``app``, feed the releases (a callable of the URL) to a gateway's DirectStreams (its
    Redis client: ``wrap`` of an in-memory one); its delivered events by request and the reports
    the worker got. ``until_finish``: after ``settle_s``, wait (up to 10 s) for a FINISH report, so
    that a loaded machine's slower stream is not cut short."""
    redis = fakeredis.aioredis.FakeRedis(decode_responses=True)
    got: dict[str, list[StreamEvent]] = {}
    direct = DirectStreams(wrap(redis), "gw1", lambda rid, evs: got.setdefault(rid, []).extend(evs), flush_s=0.02,
                           report_s=report_s, api_key=api_key)
    async with serving(app) as url:
        await direct.start()
        alive = await redis.exists(gateway_alive_key("gw1"))
        for rel in releases(url):
            await redis.rpush(gateway_inbox("gw1"), rel.to_json())
            await asyncio.sleep(0.15)
        if leave_after_s is not None:
            await asyncio.sleep(leave_after_s)
            direct.cancel("r1")
        await asyncio.sleep(settle_s)
        for _ in range(200 if until_finish else 0):
            if any('"finish"' in js for js in await redis.lrange(instance_inbox("inst"), 0, -1)):
                break
            await asyncio.sleep(0.05)
        await direct.aclose()
    reports = [StreamReport.from_dict(d) for js in await redis.lrange(instance_inbox("inst"), 0, -1)
               for d in json.loads(js)]
    return got, reports, alive


def _text(events: list[StreamEvent]) -> str:
    return "".join(e.text for e in events if e.kind is StreamKind.DELTA)


@pytest.mark.slow  # 0.62 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_release_streams_to_its_client_and_reports_its_ids_and_end():
    got, reports, alive = asyncio.run(_run(_engine(["a", "b", "c", "d"]), lambda url: [_release(url)]))
    events = got["r1"]
    assert alive and _text(events) == "abcd"
    end = events[-1]
    assert end.kind is StreamKind.END and end.text == "abcd" and end.tokens == 4 and end.finish_reason == "length"
    assert end.batch_id == "b1" and end.timings["queued_s"] == 1.0
    assert [i for r in reports for i in r.ids] == [100, 101, 102, 103]
    assert reports[-1].kind is ReportKind.FINISH and reports[-1].finish_reason == "length"


@pytest.mark.slow  # 0.78 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_progress_goes_to_the_worker_every_report_s_while_text_flows_every_flush():
    got, reports, _ = asyncio.run(_run(_engine(list("abcdefghijklmnopqrst"), delay_s=0.02),
                                       lambda url: [_release(url)], settle_s=0.6, report_s=0.2))
    deltas = [e for e in got["r1"] if e.kind is StreamKind.DELTA]
    progress = [r for r in reports if r.kind is ReportKind.PROGRESS]
    assert _text(got["r1"]) == "abcdefghijklmnopqrst" and len(deltas) >= 8  # ~0.4 s of text, a flush each 0.02 s
    assert 1 <= len(progress) <= 3 and reports[-1].kind is ReportKind.FINISH
    assert [i for r in reports for i in r.ids] == list(range(100, 120))  # every id once, in order


@pytest.mark.slow  # 1.1 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_reports_reach_the_worker_in_order_while_a_push_waits_for_redis():
    # the worker takes a row's end as final: progress that overtook it, or that it overtook, is lost.
    # The stream lasts 0.6 s, more than two report_s: a loaded machine that reads its chunks late and
    # together (once seen with a 0.3 s stream: one progress report and the end) still reports thrice.
    got, reports, _ = asyncio.run(_run(_engine(list("abcdefghijklmnopqrst"), delay_s=0.03), lambda url: [_release(url)],
                                       settle_s=0.9, wrap=FirstPushWaits, until_finish=True))
    assert _text(got["r1"]) == "abcdefghijklmnopqrst"
    assert [i for r in reports for i in r.ids] == list(range(100, 120))
    assert [r.kind for r in reports][-1] is ReportKind.FINISH and len(reports) > 2


@pytest.mark.slow  # 0.6 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_an_engine_behind_an_api_key_streams_with_it_and_refuses_without():
    got, reports, _ = asyncio.run(_run(_engine(list("abc"), key="k1"), lambda url: [_release(url)], api_key="k1"))
    assert _text(got["r1"]) == "abc" and reports[-1].kind is ReportKind.FINISH
    _, reports, _ = asyncio.run(_run(_engine(list("abc"), key="k1"), lambda url: [_release(url)]))
    assert [r.kind for r in reports] == [ReportKind.REFUSED] and "401" in reports[0].error


@pytest.mark.slow  # 0.63 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_an_emulated_length_ends_with_stop():
    got, reports, _ = asyncio.run(_run(_engine(["a", "b", "c"]), lambda url: [_release(url, limit=3, max_tokens=3)]))
    assert got["r1"][-1].finish_reason == "stop" and reports[-1].finish_reason == "stop"


@pytest.mark.slow  # 0.62 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_stop_string_across_chunks_ends_the_answer_before_it():
    got, reports, _ = asyncio.run(_run(_engine(["he", "llo ", "wo", "rld", "!!"]),
                                       lambda url: [_release(url, stop=["o w"])]))
    assert got["r1"][-1].text == "hell" and got["r1"][-1].finish_reason == "stop"
    assert _text(got["r1"]) == "hell" and reports[-1].kind is ReportKind.FINISH


@pytest.mark.slow  # 1.31 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_broken_stream_is_reported_with_its_ids_and_its_continuation_goes_on_across_the_cut():
    broken = _engine(["x", "y", "zz"], fail_after=2)

    def releases(url):
        yield _release(url, stop=["yz"])

    got, reports, _ = asyncio.run(_run(broken, releases))
    assert reports[-1].kind is ReportKind.BROKEN and [i for r in reports for i in r.ids] == [100, 101]
    # the continuation (released again, done_tokens 2) goes on from "xy": "yz" spans the cut
    resumed = _engine(["zz", "w"])

    async def both():
        redis = fakeredis.aioredis.FakeRedis(decode_responses=True)
        seen: list[StreamEvent] = []
        direct = DirectStreams(redis, "gw1", lambda rid, evs: seen.extend(evs), flush_s=0.02)
        async with serving(_engine(["x", "y", "zz"], fail_after=2)) as u1, serving(resumed) as u2:
            await direct.start()
            await redis.rpush(gateway_inbox("gw1"), _release(u1, stop=["yz"]).to_json())
            await asyncio.sleep(0.3)
            await redis.rpush(gateway_inbox("gw1"), _release(u2, stop=["yz"], done_tokens=2).to_json())
            await asyncio.sleep(0.3)
            await direct.aclose()
        return seen

    seen = asyncio.run(both())
    assert seen[-1].kind is StreamKind.END and seen[-1].text == "x" and seen[-1].finish_reason == "stop"
    assert _text(seen) == "x"


@pytest.mark.slow  # 1.38 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_refusal_and_a_client_that_leaves_are_reported():
    _, reports, _ = asyncio.run(_run(_engine(["a"], status=400), lambda url: [_release(url)]))
    assert [r.kind for r in reports] == [ReportKind.REFUSED]
    slow = _engine([f"t{i}" for i in range(200)], delay_s=0.02)
    got, reports, _ = asyncio.run(_run(slow, lambda url: [_release(url, max_tokens=200, limit=200)], leave_after_s=0.2))
    assert reports[-1].kind is ReportKind.CANCELLED and not any(e.kind is StreamKind.END for e in got["r1"])
    assert len(slow[CLOSED]) == 1  # its engine stream was closed: vLLM aborts the request


@pytest.mark.slow  # 0.25 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_release_after_the_client_left_is_refused_at_once():
    async def scenario():
        redis = fakeredis.aioredis.FakeRedis(decode_responses=True)
        direct = DirectStreams(redis, "gw1", lambda rid, evs: None, flush_s=0.02)
        async with serving(_engine(["a"])) as url:
            await direct.start()
            direct.cancel("r1")
            await redis.rpush(gateway_inbox("gw1"), _release(url).to_json())
            await asyncio.sleep(0.2)
            await direct.aclose()
        return [StreamReport.from_dict(d) for js in await redis.lrange(instance_inbox("inst"), 0, -1)
                for d in json.loads(js)]

    assert [r.kind for r in asyncio.run(scenario())] == [ReportKind.CANCELLED]


def test_stop_at_finds_the_first_stop_from_a_start():
    assert stop_at("abcabc", ["c", "b"], 0) == 1 and stop_at("abcabc", ["c"], 3) == 5
    assert stop_at("abc", [], 0) is None and stop_at("abc", [""], 0) is None
