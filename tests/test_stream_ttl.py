"""Stream keys: renewed while open (every ``STREAM_RENEW_S``), short-lived once the final event is written."""

from __future__ import annotations

from types import SimpleNamespace

import fakeredis

from cohort import bus
from cohort.logdb import get_db_engine
from cohort.protocol import FailureCode, StreamEvent
from cohort.settings import get_settings
from cohort.types import Batch, ProfiledRequest
from workers.reporting import Reporter, send
from workers.step_outputs import StepOutput


def test_open_stream_lives_past_the_request_timeout_and_a_finished_one_expires_soon():
    r = fakeredis.FakeRedis(decode_responses=True)
    s = get_settings()
    bus.publish_now(r, "a", StreamEvent.delta("hi", 1, [5]))
    open_ttl = r.ttl(bus.stream_key("a"))
    assert s.request_timeout_s < open_ttl <= s.request_timeout_s + s.stream_end_ttl_s
    bus.publish_now(r, "a", StreamEvent.error(FailureCode.CANCELLED, "gone"))
    assert 0 < r.ttl(bus.stream_key("a")) <= s.stream_end_ttl_s < open_ttl
    assert r.xlen(bus.stream_key("a")) == 2  # the events stay readable until then


def test_a_writer_renews_an_open_streams_expiry_now_and_then_and_reads_cancels_in_one_command(tmp_path):
    """A row's first delta sets its stream's expiry and later deltas within ``STREAM_RENEW_S`` leave
    it (a third fewer commands per step); its end always sets the short one. The cancel keys of the
    step's rows are read in one MGET."""
    r = fakeredis.FakeRedis(decode_responses=True)
    rt = SimpleNamespace(settings=get_settings(), redis=r, db=get_db_engine(f"sqlite:///{tmp_path}/l.db"), name="w")
    reqs = [ProfiledRequest(id=rid, prompt="p", input_tokens=1, predicted_tokens=4, max_tokens=8, arrival=0.0)
            for rid in ("a", "b")]
    rep = Reporter(rt, Batch("b1", reqs, 0.0), started=0.0)
    send(rt, [rep.stage(StepOutput(deltas=[(reqs[0], "x", 1, [5]), (reqs[1], "y", 1, [6])]), ["a", "b"], 2)])
    assert r.ttl(bus.stream_key("a")) > get_settings().request_timeout_s
    r.expire(bus.stream_key("a"), 1000)
    bus.cancel(r, "b", "default")
    commands = []
    pipeline = r.pipeline

    def counting_pipeline(*a, **k):
        pipe = pipeline(*a, **k)
        execute = pipe.execute
        pipe.execute = lambda: commands.extend(c[0][0] for c in pipe.command_stack) or execute()
        return pipe
    r.pipeline = counting_pipeline
    send(rt, [rep.stage(StepOutput(deltas=[(reqs[0], "x", 2, [7]), (reqs[1], "y", 2, [8])]), ["a", "b"], 4)])
    assert r.ttl(bus.stream_key("a")) <= 1000  # not renewed
    assert sorted(commands) == ["HINCRBY", "MGET", "XADD", "XADD"]
    assert rep.cancelled == 1 and "b" in rep.answered
