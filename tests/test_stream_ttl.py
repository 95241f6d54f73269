"""Stream keys: renewed while open, short-lived once the final event is written (issue 23)."""

from __future__ import annotations

import fakeredis

from cohort import bus
from cohort.protocol import FailureCode, StreamEvent
from cohort.settings import get_settings


def test_open_stream_lives_past_the_request_timeout_and_a_finished_one_expires_soon():
    r = fakeredis.FakeRedis(decode_responses=True)
    s = get_settings()
    bus.publish_now(r, "a", StreamEvent.delta("hi", 1, [5]))
    open_ttl = r.ttl(bus.stream_key("a"))
    assert s.request_timeout_s < open_ttl <= s.request_timeout_s + s.stream_end_ttl_s
    bus.publish_now(r, "a", StreamEvent.error(FailureCode.CANCELLED, "gone"))
    assert 0 < r.ttl(bus.stream_key("a")) <= s.stream_end_ttl_s < open_ttl
    assert r.xlen(bus.stream_key("a")) == 2  # the events stay readable until then
