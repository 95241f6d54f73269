"""The batcher service on an in-memory Redis (fakeredis: the same commands, no server), with
the Celery send replaced by a recorder. The e2e tests run it against a real Redis."""

from __future__ import annotations

import json

import fakeredis
import pytest

from batcher.policies import group_share
from batcher.service import BatcherService
from cohort import bus
from cohort.protocol import BatchOutcome, CompletionEvent, StreamEvent, StreamKind
from cohort.settings import Settings
from cohort.types import InstanceInfo, ProfiledRequest
from predictor.estimator import AnalyticBatchTime
from tests.batcher.helpers import queued

KEYS = bus.pool_keys("default")


@pytest.fixture
def r():
    return fakeredis.FakeRedis(decode_responses=True)


def register(r, name: str, theta: int = 10**9, delta: int = 1, alive: bool = True) -> None:
    info = InstanceInfo(name=name, pool="default", model="m", theta_bytes=theta, delta_bytes=delta)
    r.hset(bus.INSTANCES, name, json.dumps(info.to_dict()))
    if alive:
        r.set(bus.alive_key(name), "1", ex=60)


def arrive(r, i: int | str, L: int = 10, G: int = 10, t: float = 0.0, priority: int = 0) -> ProfiledRequest:
    rid = i if isinstance(i, str) else f"q{i}"
    req = ProfiledRequest(id=rid, prompt="p", input_tokens=L, predicted_tokens=G, max_tokens=64, arrival=t,
                          priority=priority)
    r.lpush(KEYS.incoming, json.dumps(req.to_dict()))
    return req


def complete(r, batch_id: str, outcome: str = "done", **kw) -> None:
    """What a worker sends when it leaves a batch."""
    r.lpush(KEYS.completions, CompletionEvent(batch_id, BatchOutcome(outcome), **kw).to_json())


def events(r, request_id: str) -> list[StreamEvent]:
    return [StreamEvent.from_json(f[bus.STREAM_FIELD]) for _, f in r.xrange(bus.stream_key(request_id))]


def service(r, tmp_path, sent: list, **kw) -> BatcherService:
    # the padded paths' rule (an instance takes a batch when idle) unless a test asks for continuous
    s = Settings(database_url=f"sqlite:///{tmp_path}/log.db", policy=kw.pop("policy", "magnus"),
                 wma_threshold=1e9, execution=kw.pop("execution", "elastic"), **kw)
    return BatcherService(s, r, AnalyticBatchTime(), send_task=lambda batch, target=None: sent.append(batch))


def test_nothing_is_dispatched_without_an_idle_instance(r, tmp_path):
    sent: list = []
    svc = service(r, tmp_path, sent)
    arrive(r, 0)
    svc.step(now=1.0)
    assert sent == [] and r.llen(KEYS.incoming) == 1  # no instance yet: requests wait in Redis
    register(r, "w1")
    svc.step(now=2.0)
    assert len(sent) == 1 and sent[0].size == 1
    for i in range(1, 6):
        arrive(r, i)
    svc.step(now=3.0)
    assert len(sent) == 1  # the only instance is busy: the batch keeps growing
    assert len(queued(svc.policy)) == 5 and r.hlen(KEYS.pending) == 5
    complete(r, sent[0].id)
    svc.step(now=4.0)
    assert len(sent) == 2 and sent[1].size == 5 and r.hlen(KEYS.pending) == 0


def test_restarted_batcher_recovers_pending_and_inflight(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    for i in range(4):
        arrive(r, i)
    svc.step(now=1.0)  # one batch of 4 dispatched... (all arrived before the instance was seen idle)
    for i in range(4, 7):
        arrive(r, i)
    svc.step(now=2.0)
    assert r.hlen(KEYS.inflight) == 1 and r.hlen(KEYS.pending) == 3
    again: list = []
    svc2 = service(r, tmp_path, again)  # the old process died; a new one starts from Redis
    svc2.step(now=3.0)
    assert set(svc2.inflight) == set(svc.inflight) and len(queued(svc2.policy)) == 3
    assert again == []  # still busy
    complete(r, next(iter(svc.inflight)))
    svc2.step(now=4.0)
    assert len(again) == 1 and {q.id for q in again[0].requests} == {"q4", "q5", "q6"}


def test_lost_worker_batch_is_requeued_then_failed_after_the_cap(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, max_requeues=1)
    arrive(r, 0)
    svc.step(now=1.0)
    first = sent[-1]
    r.set(bus.claim_key(first.id), "w1")
    r.delete(bus.alive_key("w1"))          # w1 died mid-batch
    register(r, "w2")                      # another instance is up
    svc.step(now=2.0)
    assert r.get(bus.claim_key(first.id)) == bus.CANCELLED  # a redelivery of the old task is a no-op
    second = sent[-1]
    assert second.id != first.id and second.attempt == 1 and [q.id for q in second.requests] == ["q0"]
    r.set(bus.claim_key(second.id), "w2")
    r.delete(bus.alive_key("w2"))
    register(r, "w3")
    svc.step(now=3.0)
    (ev,) = events(r, "q0")
    assert ev.kind is StreamKind.ERROR and ev.code == "worker_lost"


def test_oom_completion_splits_and_a_single_fails(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, policy="abp")  # FCFS over batches: the first half runs first
    for i in range(3):
        arrive(r, i)
    svc.step(now=1.0)
    b = sent[-1]
    assert b.size == 3
    complete(r, b.id, "oom", error="CUDA out of memory")
    svc.step(now=2.0)
    assert [x.size for x in sent[1:]] == [2]  # one instance: the first half runs, the second waits
    complete(r, sent[1].id)
    svc.step(now=3.0)
    single = sent[-1]
    assert single.size == 1
    complete(r, single.id, "oom", error="CUDA out of memory")
    svc.step(now=4.0)
    (ev,) = events(r, single.requests[0].id)
    assert ev.code == "out_of_memory" and "single request" in ev.message
    assert int(r.hget(bus.STATS, "oom_splits")) == 2


def test_split_halves_survive_a_batcher_crash(r, tmp_path):
    """Halves of an OOM batch live in Redis, not only in the batcher's memory."""
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, policy="abp")
    arrive(r, 0)
    svc.step(now=1.0)  # q0 runs alone
    for i in range(1, 5):
        arrive(r, i)
    svc.step(now=2.0)
    complete(r, sent[0].id)
    svc.step(now=3.0)  # q1..q4 dispatched as one batch
    big = sent[-1]
    assert big.size == 4
    complete(r, big.id, "oom", error="CUDA out of memory")
    svc._take_completions(4.0, svc._read()[2], r.pipeline())  # split and re-queued; dies before its round's transaction
    assert r.hlen(KEYS.inflight) == 0 and set(r.hkeys(KEYS.pending)) == {"q1", "q2", "q3", "q4"}
    again: list = []
    svc2 = service(r, tmp_path, again, policy="abp")
    svc2.step(now=5.0)
    assert {q.id for b in again for q in b.requests} | {q.id for q in queued(svc2.policy)} \
        == {"q1", "q2", "q3", "q4"}


def test_a_message_read_before_a_crash_is_not_taken_twice(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    arrive(r, 0)
    svc.step(now=1.0)
    arrive(r, 1)
    r.hset(KEYS.pending, "q1", r.lindex(KEYS.incoming, -1))  # taken, then the process died before trimming
    svc2 = service(r, tmp_path, [])
    svc2.step(now=2.0)
    assert len(queued(svc2.policy)) == 1 and r.llen(KEYS.incoming) == 0


def test_batch_delivered_to_a_worker_that_died_before_claiming_it_is_requeued(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, instance_ttl_s=5)
    arrive(r, 0)
    svc.step(now=100.0)
    first = sent[-1]
    r.lpush(bus.queue_for_pool("default"), json.dumps({"headers": {"id": first.id}}))
    svc.step(now=120.0)
    assert len(sent) == 1  # still waiting in the Celery queue: not lost
    r.delete(bus.queue_for_pool("default"))  # delivered to a worker that died before claiming
    svc.step(now=121.0)
    assert len(sent) == 2 and sent[-1].attempt == 1 and r.get(bus.claim_key(first.id)) == bus.CANCELLED


def test_continuations_wait_again_and_answered_rows_are_not_split(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, policy="abp")
    for i in range(3):
        arrive(r, i)
    svc.step(now=1.0)
    b = sent[-1]
    q2 = b.requests[2]
    cont = q2.continuation([7, 8, 9], 1.5)
    complete(r, b.id, answered=["q0", "q1"], continuations=[cont])
    svc.step(now=2.0)
    again = sent[-1]
    assert [q.id for q in again.requests] == ["q2"] and again.requests[0].generated_ids == [7, 8, 9]
    assert again.requests[0].preemptions == 1 and int(r.hget(bus.STATS, "preemptions")) == 1
    assert r.hlen(KEYS.inflight) == 1
    complete(r, again.id, "oom", error="x", answered=[])  # split recovery only splits unanswered rows
    svc.step(now=3.0)
    (ev,) = events(r, "q2")
    assert ev.code == "out_of_memory"


def test_cancelled_requests_never_reach_a_worker(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    arrive(r, 0)
    svc.step(now=1.0)  # q0 runs; q1, q2 wait
    arrive(r, 1)
    arrive(r, 2)
    svc.step(now=2.0)
    r.set(bus.cancel_key("q1"), "1")
    r.lpush(KEYS.cancels, "q1")
    svc.step(now=3.0)
    assert not r.hexists(KEYS.pending, "q1") and r.hexists(KEYS.pending, "q2")
    complete(r, sent[0].id, answered=["q0"])
    svc.step(now=4.0)
    assert [q.id for q in sent[-1].requests] == ["q2"]


def test_a_lost_batch_resumes_from_its_streams(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    for i in range(3):
        arrive(r, i)
    svc.step(now=1.0)
    first = sent[-1]
    bus.publish_now(r, "q0", StreamEvent(StreamKind.END, text="done", tokens=2))   # answered before the crash
    bus.publish_now(r, "q1", StreamEvent.delta("ab", 2, [11, 12]))                # half streamed
    r.set(bus.claim_key(first.id), "w1")
    r.delete(bus.alive_key("w1"))
    register(r, "w2")
    svc.step(now=2.0)
    again = {q.id: q for q in sent[-1].requests}
    assert set(again) == {"q1", "q2"}  # q0 is never answered twice
    assert again["q1"].generated_ids == [11, 12] and again["q1"].max_tokens == 62
    assert again["q2"].generated_ids == []


def test_dead_instances_are_pruned_from_the_registry(r, tmp_path):
    register(r, "w1")
    register(r, "w2", alive=False)  # its heartbeat expired
    svc = service(r, tmp_path, [])
    svc.step(now=1.0)
    assert set(svc.instances) == {"w1"} and set(r.hkeys(bus.INSTANCES)) == {"w1"}


def test_a_missing_heartbeat_right_after_a_redis_restart_kills_nobody(r, tmp_path, monkeypatch):
    """A Redis that came back younger than a heartbeat TTL may have lost the heartbeats of live
    instances: their batches are not re-run elsewhere, their registrations stay; once Redis is
    older than a TTL, a missing heartbeat is a death again."""
    uptime = [1.0]
    monkeypatch.setattr(bus, "redis_uptime_s", lambda _r: uptime[0])
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, instance_ttl_s=15.0)
    arrive(r, 0)
    svc.step(now=1.0)
    r.set(bus.claim_key(sent[-1].id), "w1")
    r.delete(bus.alive_key("w1"))  # Redis restarted without it; w1 still runs the batch
    svc.step(now=3.0)
    assert len(sent) == 1 and r.get(bus.claim_key(sent[0].id)) == "w1" and set(r.hkeys(bus.INSTANCES)) == {"w1"}
    uptime[0] = 20.0  # a TTL later w1 never beat again: it is dead
    register(r, "w2")
    svc.step(now=5.0)
    assert len(sent) == 2 and r.get(bus.claim_key(sent[0].id)) == bus.CANCELLED


def test_overload_sheds_the_least_urgent_newest_requests(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent, max_pending=3)
    arrive(r, 0)
    svc.step(now=1.0)  # q0 runs; the rest wait
    for i, (prio, t) in enumerate([(1, 2.0), (0, 3.0), (1, 4.0), (2, 5.0), (0, 6.0)], start=1):
        arrive(r, f"p{i}", t=t, priority=prio)
        svc.step(now=t)
    # 5 waited, 3 fit: the priority-2 one and the newest priority-1 one are shed
    assert sorted(r.hkeys(KEYS.pending)) == ["p1", "p2", "p5"]
    for shed in ("p3", "p4"):
        (ev,) = events(r, shed)
        assert ev.code == "queue_full" and r.exists(bus.cancel_key(shed))
    assert r.get(KEYS.worst_priority) == "1" and int(r.hget(bus.STATS, "shed")) == 2
    complete(r, sent[0].id, answered=["q0"])
    svc.step(now=7.0)
    assert {q.id for q in sent[-1].requests} <= {"p2", "p5"}  # the most urgent level goes first


def test_the_worst_waiting_priority_follows_dispatch(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    arrive(r, "a", t=1.0, priority=0)
    svc.step(now=1.0)  # a runs
    arrive(r, "b", t=2.0, priority=3)
    svc.step(now=2.0)
    assert r.get(KEYS.worst_priority) == "3"
    complete(r, sent[-1].id, answered=["a"])
    svc.step(now=3.0)  # b leaves: nothing waits any more
    assert [q.id for q in sent[-1].requests] == ["b"] and r.get(KEYS.worst_priority) is None


def test_continuous_keeps_the_lookahead_of_batches_waiting_to_be_admitted(r, tmp_path):
    sent: list = []
    svc = service(r, tmp_path, sent, execution="continuous", continuous={"max_groups": 3, "lookahead": 1},
                  fixed_batch_size=1, policy="vs")
    register(r, "w1")
    for i in range(6):
        arrive(r, i, t=i)
    svc.step(now=10.0)
    assert len(sent) == 1  # the instance has not admitted it yet: nothing more goes out
    svc.step(now=10.1)
    assert len(sent) == 1
    r.set(bus.admitted_key(sent[0].id), "w1")  # its rows run: the next one may wait at the worker
    svc.step(now=10.2)
    assert len(sent) == 2
    r.set(bus.admitted_key(sent[1].id), "w1")
    svc.step(now=10.3)
    r.set(bus.admitted_key(sent[2].id), "w1")
    svc.step(now=10.4)
    assert len(sent) == 3  # three running batches fill the instance's thread slots
    complete(r, sent[0].id, answered=[q.id for q in sent[0].requests])
    svc.step(now=10.5)
    assert len(sent) == 4


def test_a_lost_batch_never_reruns_a_row_whose_record_is_settled(r, tmp_path):
    """Its stream may have expired (streams live a short while after their answer): the log-DB
    record, settled before the answer was published, still says it was answered."""
    from cohort.logdb import finish_request, get_db_engine, record_request

    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    for i in range(2):
        arrive(r, i)
    svc.step(now=1.0)
    first = sent[-1]
    db = get_db_engine(svc.settings.database_url)
    for q in first.requests:
        record_request(db, {"id": q.id, "created": 0.0, "model": "m", "status": "queued"})
    finish_request(db, "q0", status="done", actual_tokens=3)  # answered; its stream already expired
    r.set(bus.claim_key(first.id), "w1")
    r.delete(bus.alive_key("w1"))
    register(r, "w2")
    svc.step(now=2.0)
    assert [q.id for q in sent[-1].requests] == ["q1"]


def test_an_arrival_already_in_pending_but_unknown_to_the_batcher_is_taken(r, tmp_path):
    """A Redis restart can drop the reply to the batcher's HSETNX after Redis applied it; the
    client's retry then answers 0. Such a request is in ``pending`` and nowhere else: it must
    still be scheduled, not left there until its client times out."""
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    svc.step(now=1.0)  # the policy exists; nothing waits
    req = arrive(r, 7, t=1.5)
    r.hset(KEYS.pending, req.id, json.dumps(req.to_dict()))  # applied, reply lost
    svc.step(now=2.0)
    assert [q.id for b in sent for q in b.requests] == ["q7"]


def test_a_pool_of_upstreams_plans_larger_admission_groups(r, tmp_path):
    """An upstream runs each row as its own stream: its groups are planned with
    COHORT_UPSTREAM_GROUP_FRAC of Θ, a built-in instance's with COHORT_CONTINUOUS__GROUP_FRAC."""
    up = InstanceInfo(name="u", pool="default", model="m", theta_bytes=10**6, delta_bytes=1, device="upstream:http://x")
    own = InstanceInfo(name="w", pool="default", model="m", theta_bytes=10**6, delta_bytes=1)
    assert up.upstream and not own.upstream
    assert Settings(_env_file=None).upstream_group_frac == 0.2
    assert group_share("continuous", True, 0.01, 0.2) == 0.2
    assert group_share("continuous", False, 0.01, 0.2) == 0.01       # a mixed pool keeps the built-in share
    assert group_share("elastic", True, 0.01, 0.2) == 1.0             # padded execution: the whole Θ
    r.hset(bus.INSTANCES, "u", json.dumps(up.to_dict()))
    r.set(bus.alive_key("u"), "1", ex=60)
    svc = service(r, tmp_path, [], execution="continuous", memory_headroom=0.0)
    svc.step(now=1.0)
    assert svc.policy.ctx.memory.theta_bytes == int(10**6 * 0.2)


class _CountingRedis(fakeredis.FakeRedis):
    """Counts round trips: each command sent alone and each pipeline sent."""

    trips = 0

    def execute_command(self, *args, **kw):
        type(self).trips += 1
        return super().execute_command(*args, **kw)

    def pipeline(self, transaction: bool = True, shard_hint=None):
        pipe = super().pipeline(transaction, shard_hint)
        execute = pipe.execute

        def counted(*a, **kw):
            type(self).trips += 1
            return execute(*a, **kw)

        pipe.execute = counted
        return pipe


def test_a_request_that_arrives_and_leaves_in_one_round_costs_the_read_and_one_transaction(tmp_path):
    r = _CountingRedis(decode_responses=True)
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    svc.step(now=1.0)  # the instances are read, the lost batches looked for
    arrive(r, 0)
    _CountingRedis.trips = 0
    svc.step(now=1.1)  # before either is due again
    assert _CountingRedis.trips == 2  # the round's read; arrivals and dispatch in one transaction
    assert len(sent) == 1 and r.hlen(KEYS.pending) == 0 and r.llen(KEYS.incoming) == 0
    assert r.hlen(KEYS.inflight) == 1


def test_a_completion_and_the_next_dispatch_share_the_rounds_transaction(tmp_path):
    r = _CountingRedis(decode_responses=True)
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    svc.step(now=1.0)
    arrive(r, 0)
    svc.step(now=1.1)  # q0 runs
    complete(r, sent[0].id)
    arrive(r, 1)
    _CountingRedis.trips = 0
    svc.step(now=1.2)
    assert _CountingRedis.trips == 2  # the read; q0's batch retired, its message trimmed, q1 dispatched: one transaction
    assert len(sent) == 2 and r.hkeys(KEYS.inflight) == [sent[1].id] and r.llen(KEYS.completions) == 0


def test_an_arrival_cancelled_in_its_own_round_leaves_nothing_in_pending(r, tmp_path):
    register(r, "w1")
    sent: list = []
    svc = service(r, tmp_path, sent)
    arrive(r, 0)
    svc.step(now=1.0)  # q0 runs: the instance is busy
    arrive(r, 1)
    arrive(r, 2)
    r.set(bus.cancel_key("q1"), "1")
    r.lpush(KEYS.cancels, "q1")  # withdrawn before the batcher took it in
    svc.step(now=2.0)
    assert not r.hexists(KEYS.pending, "q1") and r.hexists(KEYS.pending, "q2")
    assert r.llen(KEYS.incoming) == 0 and r.llen(KEYS.cancels) == 0


def test_the_batcher_says_whether_requests_wait_for_room(r, tmp_path):
    """Workers wake it for an admission or a plain end only while this says so (``cohort.batcher_hunger``)."""
    sent: list = []
    svc = service(r, tmp_path, sent, execution="continuous", continuous={"max_groups": 3, "lookahead": 1},
                  fixed_batch_size=1, policy="vs")
    register(r, "w1")
    arrive(r, 0, t=0)
    svc.step(now=1.0)
    assert len(sent) == 1 and not r.exists(KEYS.hungry)  # it went out: nothing waits
    arrive(r, 1, t=1)
    svc.step(now=1.1)
    assert len(sent) == 1 and r.exists(KEYS.hungry)  # q1 waits for q0's admission
    r.set(bus.admitted_key(sent[0].id), "w1")
    svc.step(now=1.2)
    assert len(sent) == 2 and not r.exists(KEYS.hungry)
