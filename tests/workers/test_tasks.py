"""The batch task's Redis writes wait out an outage instead of failing the batch."""

from __future__ import annotations

import fakeredis
import pytest
import redis

from cohort import bus
from cohort.protocol import StreamEvent
from workers.reporting import execute


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
    out = execute(r, lambda p: bus.publish(p, "q1", StreamEvent.delta("hi", 1, [5])), "test", limit_s=30, first_backoff_s=0.01)
    assert r.attempts == 3 and out[0]  # the XADD of the third attempt
    assert [f[bus.STREAM_FIELD] for _, f in r.inner.xrange(bus.stream_key("q1"))] == [
        StreamEvent.delta("hi", 1, [5]).to_json()]  # written once: failed attempts wrote nothing


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_a_long_outage_still_ends_in_an_error():
    r = FlakyRedis(fail=10**6)
    with pytest.raises(redis.ConnectionError):
        execute(r, lambda p: p.exists("x"), "test", limit_s=0.2, first_backoff_s=0.01)


def test_a_finished_batch_keeps_only_its_done_marker_for_two_visibility_timeouts():
    """Redis stays flat under steady load: a batch's claim and admitted markers go when it ends,
    and its done marker (what stops a redelivery) lives 2× the visibility timeout, not days."""
    from types import SimpleNamespace

    from cohort.protocol import BatchOutcome, CompletionEvent
    from cohort.settings import Settings
    from workers.reporting import complete, mark_admitted
    from workers.tasks import claim

    r = fakeredis.FakeRedis(decode_responses=True)
    rt = SimpleNamespace(redis=r, name="w1", settings=Settings(visibility_timeout_s=600))
    assert claim(rt, "b1")
    mark_admitted(rt, "b1")
    assert 0 < r.ttl(bus.claim_key("b1")) <= 1200 and 0 < r.ttl(bus.admitted_key("b1")) <= 1200
    complete(rt, CompletionEvent(batch_id="b1", outcome=BatchOutcome.DONE))
    assert not r.exists(bus.claim_key("b1")) and not r.exists(bus.admitted_key("b1"))
    assert 1190 < r.ttl(bus.done_key("b1")) <= 1200
    assert not claim(rt, "b1")  # a redelivery of the finished batch's task is a no-op
