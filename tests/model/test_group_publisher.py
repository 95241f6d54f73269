"""Continuous execution's one publisher: every group's step goes out in shared rounds, each group
ends with its own completion and batch row, a second copy of a running batch is skipped, and a
round that cannot be sent fails its groups explicitly (real engine loop, fakeredis, SQLite)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import fakeredis
import pytest
import torch
from sqlalchemy import select

from cohort import bus
from cohort.logdb import batches, get_db_engine, record_requests, requests
from cohort.protocol import BatchOutcome, CompletionEvent, StreamEvent, StreamKind
from cohort.settings import Settings
from cohort.types import Batch, ProfiledRequest
from workers import group_publisher
from workers.continuous import ContinuousRun
from workers.continuous_loop import ContinuousLoop
from workers.group_publisher import GroupPublisher

PROMPT = "Translate to French: good morning"


@pytest.fixture
def stack(engine, tmp_path):
    loop = ContinuousLoop(lambda: ContinuousRun(engine.model, engine.tokenizer, engine.device, torch.float32,
                                                num_pages=128, page_size=8, token_budget=16))
    settings = Settings(visibility_timeout_s=600)
    rt = SimpleNamespace(redis=fakeredis.FakeRedis(decode_responses=True), db=get_db_engine(f"sqlite:///{tmp_path}/log.db"),
                         name="w1", settings=settings)
    pub = GroupPublisher(rt, loop)
    yield rt, loop, pub
    pub.stop()
    loop.stop()


def batch(bid: str, lengths: list[int], rt) -> Batch:
    reqs = [ProfiledRequest(id=f"{bid}-r{i}", prompt=PROMPT, input_tokens=5, arrival=time.time(),
                            predicted_tokens=n, max_tokens=n) for i, n in enumerate(lengths)]
    record_requests(rt.db, [{"id": r.id} for r in reqs])
    return Batch(id=bid, requests=reqs, created=time.time())


def events(rt, rid: str) -> list[StreamEvent]:
    return [StreamEvent.from_json(f[bus.STREAM_FIELD]) for _, f in rt.redis.xrange(bus.stream_key(rid))]


def completions(rt) -> dict[str, CompletionEvent]:
    raw = rt.redis.lrange(bus.pool_keys(rt.settings.pool).completions, 0, -1)
    return {e.batch_id: e for e in map(CompletionEvent.from_json, raw)}


def test_every_group_is_answered_and_ends_with_its_own_completion(stack, engine):
    rt, loop, pub = stack
    groups = [batch("A", [6, 3], rt), batch("B", [4], rt), batch("C", [5, 2, 7], rt)]
    for b in groups:
        assert pub.submit(b, [engine.prompt_ids(PROMPT)] * b.size)
    assert pub.drain(30.0) and loop.run.idle
    done = completions(rt)
    assert set(done) == {"A", "B", "C"}
    for b in groups:
        ev = done[b.id]
        assert ev.outcome is BatchOutcome.DONE and sorted(ev.answered) == sorted(r.id for r in b.requests)
        assert ev.generated_tokens == [r.max_tokens for r in b.requests]
        assert rt.redis.get(bus.done_key(b.id)) == BatchOutcome.DONE.value
        assert not rt.redis.exists(bus.admitted_key(b.id))  # set on admission, gone at the end
        for r in b.requests:
            evs = events(rt, r.id)
            deltas = [e for e in evs if e.kind is StreamKind.DELTA]
            assert evs[-1].kind is StreamKind.END and evs[-1].tokens == r.max_tokens
            assert "".join(e.text for e in deltas) == evs[-1].text and sum(len(e.ids) for e in deltas) == r.max_tokens
    with rt.db.connect() as conn:
        rows = {row.id: row for row in conn.execute(select(requests))}
        assert all(row.status == "done" and row.batch_id == row.id.split("-")[0] for row in rows.values())
        assert {row.id for row in conn.execute(select(batches))} == {"A", "B", "C"}


def test_a_second_copy_of_a_running_batch_is_skipped(stack, engine):
    rt, loop, pub = stack
    b = batch("A", [12], rt)
    assert pub.submit(b, [engine.prompt_ids(PROMPT)])
    assert not pub.submit(b, [engine.prompt_ids(PROMPT)])  # its first copy answers
    assert pub.drain(30.0)
    assert [e.kind for e in events(rt, "A-r0")].count(StreamKind.END) == 1


def test_a_round_that_cannot_be_sent_fails_its_groups_explicitly(stack, engine, monkeypatch):
    rt, loop, pub = stack
    real_send, calls = group_publisher.send, []

    def broken_send(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("log DB gone")
        return real_send(*args, **kwargs)

    monkeypatch.setattr(group_publisher, "send", broken_send)
    b = batch("A", [40, 40], rt)
    assert pub.submit(b, [engine.prompt_ids(PROMPT)] * 2)
    assert pub.drain(30.0)
    ev = completions(rt)["A"]
    assert ev.outcome is BatchOutcome.FAILED and sorted(ev.answered) == ["A-r0", "A-r1"]
    for rid in ("A-r0", "A-r1"):
        assert events(rt, rid)[-1].kind is StreamKind.ERROR
    deadline = time.monotonic() + 10
    while not loop.run.idle and time.monotonic() < deadline:  # its rows left the engine too
        time.sleep(0.05)
    assert loop.run.idle
    with rt.db.connect() as conn:
        assert {row.status for row in conn.execute(select(requests))} == {"failed"}
