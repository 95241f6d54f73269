"""An upstream instance takes its groups off the Redis sets best first, its own set before the pool's."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace

import fakeredis

from cohort.release_bus import group_set, hand_over
from cohort.types import Batch, ProfiledRequest
from workers import group_inbox


def _group(r, key: str, name: str, rank: float) -> None:
    batch = Batch(id=name, requests=[ProfiledRequest(id=f"{name}-q", prompt="p", input_tokens=4, predicted_tokens=4,
                                                     max_tokens=8, arrival=0.0)], created=0.0)
    pipe = r.pipeline()
    hand_over(pipe, key, 0, rank, json.dumps(batch.to_dict()))
    pipe.execute()


def test_the_instance_takes_its_own_groups_first_then_the_pools_best_first(monkeypatch):
    r = fakeredis.FakeRedis(decode_responses=True)
    stop, taken = threading.Event(), []

    def run_batch(rt, batch: Batch) -> None:
        taken.append(batch.id)
        if len(taken) == 4:
            stop.set()

    monkeypatch.setattr(group_inbox, "run_batch", run_batch)
    _group(r, group_set("default"), "pool-late", 30.0)
    _group(r, group_set("default"), "pool-early", 10.0)
    _group(r, group_set("default", "u1"), "own-b", 50.0)
    _group(r, group_set("default", "u1"), "own-a", 40.0)
    rt = SimpleNamespace(settings=SimpleNamespace(pool="default"), name="u1", redis=r)
    group_inbox.serve_groups(rt, stop)
    assert taken == ["own-a", "own-b", "pool-early", "pool-late"]
