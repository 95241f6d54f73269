"""Per-request priority: strict across levels, each level keeps its policy's own rules."""

from __future__ import annotations

from dataclasses import replace

import pytest

from batcher.policies import POLICIES, make_policy
from tests.batcher.helpers import ctx, req


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_more_urgent_request_goes_first_and_never_shares_a_batch(name):
    p = make_policy(name, ctx(), threshold=1e12)
    old = [replace(req(10, 10, arrival=0.0), priority=1) for _ in range(3)]
    urgent = replace(req(10, 10, arrival=5.0), priority=0)
    for r in old:
        p.add(r, r.arrival)
    p.add(urgent, 5.0)
    first = p.pop(6.0)
    assert [r.id for r in first.requests] == [urgent.id]  # younger, but more urgent
    rest = []
    while (b := p.pop(7.0)) is not None:
        rest += [r.id for r in b.requests]
    assert sorted(rest) == sorted(r.id for r in old)


def test_a_requeued_batch_returns_to_its_level():
    p = make_policy("magnus", ctx(), threshold=1e12)
    low = replace(req(10, 10, arrival=0.0), priority=5)
    p.add(low, 0.0)
    b = p.pop(1.0)
    p.add(replace(req(10, 10, arrival=2.0), priority=0), 2.0)
    p.requeue(b, 3.0)
    assert p.pop(4.0).requests[0].priority == 0 and p.pop(4.0).requests[0].id == low.id
