"""The simulator's prefix-aware routing (``bench.group_engine.GroupScheduler.pop``): an instance with
room takes, of the next groups, one whose prefix no other instance with room holds more of; a group
better placed elsewhere waits for that instance, and a pop that leaves every group names it."""

from __future__ import annotations

from bench.continuous import EngineLimits
from bench.group_engine import GroupScheduler
from cohort.types import Batch, ProfiledRequest


class _Fixed:
    def __init__(self, batches: list[Batch]) -> None:
        self.batches = batches

    def add(self, req: ProfiledRequest, now: float) -> None:
        pass

    def pop(self, now: float) -> Batch | None:
        return self.batches.pop(0) if self.batches else None


def _queue(*prompts: list[int]) -> tuple[GroupScheduler, list[Batch]]:
    reqs = [ProfiledRequest(id=f"r{i}", prompt="", input_tokens=len(p), arrival=0.0, predicted_tokens=4,
                            max_tokens=8, prompt_ids=p) for i, p in enumerate(prompts)]
    batches = [Batch(id=f"g{i}", requests=[r], created=0.0) for i, r in enumerate(reqs)]
    q = GroupScheduler(_Fixed(list(batches)), EngineLimits(page_tokens=4), affinity=8)  # type: ignore[arg-type]
    for r in reqs:
        q.add(r, 0.0)
    return q, batches


def _held(q: GroupScheduler, batch: Batch, pages: int) -> dict[tuple[int, ...], int]:
    return {tuple(q.pages(batch.requests[0])): pages}


def test_a_group_whose_prefix_another_instance_holds_waits_for_it():
    q, (a, b) = _queue(list(range(12)), list(range(100, 112)))
    on_y = _held(q, a, 3)                     # instance 7 (with room) holds a's prompt
    got = q.pop(0.0, lambda h: 0, lambda h: (on_y.get(tuple(h), 0), 7))
    assert got is b and not q.declined        # x takes b, which nobody holds
    assert q.pop(0.0, lambda h: 0, lambda h: (on_y.get(tuple(h), 0), 7)) is None
    assert q.declined == {7} and q.queued == 1
    q.declined.clear()
    assert q.pop(0.0, lambda h: on_y.get(tuple(h), 0), lambda h: (0, 1)) is a   # instance 7 pulls it
    assert q.queued == 0


def test_the_longest_prefix_here_wins_and_no_room_elsewhere_means_take_it():
    q, (a, b) = _queue(list(range(12)), list(range(100, 112)))
    here = {**_held(q, a, 1), **_held(q, b, 2)}
    assert q.pop(0.0, lambda h: here.get(tuple(h), 0), lambda h: (0, -1)) is b
    # a is held better by an instance without room (it reports nothing): x takes it
    assert q.pop(0.0, lambda h: here.get(tuple(h), 0), lambda h: (0, -1)) is a


def test_without_affinity_the_policy_order_stands():
    q, (a, b) = _queue(list(range(12)), list(range(100, 112)))
    q.affinity = 0
    assert q.pop(0.0, lambda h: 0, lambda h: (5, 7)) is a and not q.declined
