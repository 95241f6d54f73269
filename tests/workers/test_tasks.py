"""The batch task's Redis writes wait out an outage instead of failing the batch."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from cohort import bus
from cohort.protocol import StreamEvent
from workers.tasks import _execute


class FlakyRedis:
    """fakeredis whose first ``fail`` pipelines lose the connection when executed."""

    def __init__(self, fail: int) -> None:
        self.inner, self.fail, self.attempts = fakeredis.FakeRedis(decode_responses=True), fail, 0

    def pipeline(self, transaction: bool = False):
        pipe = self.inner.pipeline(transaction=transaction)
        self.attempts += 1
        if self.attempts <= self.fail:
            def broken():
                pipe.reset()
                raise redis.ConnectionError("Connection refused")
            pipe.execute = broken
        return pipe


def test_events_go_out_once_redis_is_back():
    r = FlakyRedis(fail=2)
    out = _execute(r, lambda p: bus.publish(p, "q1", StreamEvent.delta("hi", 1, [5])), "test", limit_s=30, first_backoff_s=0.01)
    assert r.attempts == 3 and out[0]  # the XADD of the third attempt
    assert [f[bus.STREAM_FIELD] for _, f in r.inner.xrange(bus.stream_key("q1"))] == [
        StreamEvent.delta("hi", 1, [5]).to_json()]  # written once: failed attempts wrote nothing


def test_a_long_outage_still_ends_in_an_error():
    r = FlakyRedis(fail=10**6)
    with pytest.raises(redis.ConnectionError):
        _execute(r, lambda p: p.exists("x"), "test", limit_s=0.2, first_backoff_s=0.01)
