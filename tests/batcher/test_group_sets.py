"""An upstream-only pool's groups go on Redis sorted sets, in the round trip that records them in
flight (no Celery task); a pool with a built-in instance keeps Celery. A group popped by an
instance that died before claiming it is re-queued, as an unclaimed Celery task is."""

from __future__ import annotations

import json

import fakeredis

from batcher.service import BatcherService
from cohort import bus
from cohort.release_bus import group_payload, group_set
from cohort.settings import Settings
from cohort.types import Batch, InstanceInfo
from predictor.estimator import AnalyticBatchTime
from tests.batcher.test_service import KEYS, arrive


def _register(r, name: str, upstream: bool) -> None:
    info = InstanceInfo(name=name, pool="default", model="m", theta_bytes=10**6, delta_bytes=1,
                        device="upstream:http://e/v1" if upstream else "cpu")
    r.hset(bus.INSTANCES, name, json.dumps(info.to_dict()))
    r.set(bus.alive_key(name), "1", ex=60)


def _service(r, tmp_path, sent: list, **kw) -> BatcherService:
    s = Settings(database_url=f"sqlite:///{tmp_path}/log.db", policy=kw.pop("policy", "magnus"), wma_threshold=1e9,
                 execution="continuous", instance_ttl_s=5, **kw)
    return BatcherService(s, r, AnalyticBatchTime(), send_task=lambda batch, target=None: sent.append(batch))


def test_an_upstream_only_pool_gets_its_groups_on_a_list(tmp_path):
    r = fakeredis.FakeRedis(decode_responses=True)
    _register(r, "u1", upstream=True)
    sent: list = []
    svc = _service(r, tmp_path, sent, prefix_routing=False)  # the pool's set (placed groups: below)
    for i in range(3):
        arrive(r, i)
    svc.step(now=100.0)
    listed = [Batch.from_dict(json.loads(group_payload(js))) for js in r.zrange(group_set("default"), 0, -1)]
    assert sent == [] and listed and {q.id for b in listed for q in b.requests} == {"q0", "q1", "q2"}
    assert set(r.hkeys(KEYS.inflight)) == {b.id for b in listed} and r.llen(KEYS.incoming) == 0
    # popped by an instance that died before claiming it: re-queued once unclaimed for two TTLs
    r.delete(group_set("default"))
    svc.step(now=100.5)
    assert r.zcard(group_set("default")) == 0
    svc.step(now=111.0)
    again = [Batch.from_dict(json.loads(group_payload(js))) for js in r.zrange(group_set("default"), 0, -1)]
    assert again and all(b.attempt == 1 for b in again)


def test_a_pool_with_a_builtin_instance_keeps_celery(tmp_path):
    r = fakeredis.FakeRedis(decode_responses=True)
    _register(r, "u1", upstream=True)
    _register(r, "b1", upstream=False)
    sent: list = []
    svc = _service(r, tmp_path, sent)
    arrive(r, 0)
    svc.step(now=100.0)
    assert len(sent) == 1 and r.zcard(group_set("default")) == 0


def test_placed_groups_go_on_the_least_loaded_instances_list(tmp_path):
    r = fakeredis.FakeRedis(decode_responses=True)
    _register(r, "u1", upstream=True)
    _register(r, "u2", upstream=True)
    sent: list = []
    svc = _service(r, tmp_path, sent, continuous={"group_frac": 1e-6})  # a group per request
    arrive(r, 0)
    svc.step(now=100.0)
    arrive(r, 1)
    svc.step(now=100.1)
    own = {n: [Batch.from_dict(json.loads(group_payload(js))) for js in r.zrange(group_set("default", n), 0, -1)] for n in ("u1", "u2")}
    assert r.zcard(group_set("default")) == 0 and sent == []
    assert sorted(q.id for n in own for b in own[n] for q in b.requests) == ["q0", "q1"]
    assert len(own["u1"]) == 1 and len(own["u2"]) == 1  # the second went where nothing was in flight


def _waiting(r, key: str) -> list[list[str]]:
    """The ids of each group on a sorted set, in the order instances take them."""
    return [[q.id for q in Batch.from_dict(json.loads(group_payload(js))).requests] for js in r.zrange(key, 0, -1)]


def test_instances_take_the_pools_groups_in_the_policys_order_not_the_hand_over_order(tmp_path):
    r = fakeredis.FakeRedis(decode_responses=True)
    _register(r, "u1", upstream=True)
    svc = _service(r, tmp_path, [], prefix_routing=False, continuous={"group_frac": 1e-6},
                   policy="spf")  # shortest predicted first: a static rank, kept on the set
    arrive(r, "long", G=200)
    svc.step(now=100.0)
    arrive(r, "short", G=5)
    arrive(r, "urgent-long", G=150, priority=-1)
    svc.step(now=100.1)
    # handed over long first; the short one passes it, and the more urgent client priority both
    assert _waiting(r, group_set("default")) == [["urgent-long"], ["short"], ["long"]]


def test_a_policy_whose_order_moves_with_time_keeps_the_hand_over_order(tmp_path):
    r = fakeredis.FakeRedis(decode_responses=True)
    _register(r, "u1", upstream=True)
    svc = _service(r, tmp_path, [], prefix_routing=False, continuous={"group_frac": 1e-6})  # magnus: HRRN
    arrive(r, "long", G=200)
    svc.step(now=100.0)
    arrive(r, "short", G=5)
    svc.step(now=100.1)
    assert _waiting(r, group_set("default")) == [["long"], ["short"]]


def test_a_group_left_on_an_earlier_versions_plain_list_is_requeued_onto_the_sets(tmp_path):
    r = fakeredis.FakeRedis(decode_responses=True)
    _register(r, "u1", upstream=True)
    svc = _service(r, tmp_path, [], prefix_routing=False)
    arrive(r, 0)
    svc.step(now=100.0)
    (member,) = r.zrange(group_set("default"), 0, -1)
    r.delete(group_set("default"))  # where an earlier version kept it: a plain list nobody reads now
    r.rpush(f"{bus.PREFIX}:groups:default", group_payload(member))
    fresh = _service(r, tmp_path, [], prefix_routing=False)  # the upgraded batcher takes over
    fresh.step(now=100.5)
    assert r.zcard(group_set("default")) == 0
    fresh.step(now=111.0)  # unclaimed for two heartbeat TTLs and on no set: re-queued
    assert _waiting(r, group_set("default")) == [["q0"]]
