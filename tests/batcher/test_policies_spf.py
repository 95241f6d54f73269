"""spf: shortest predicted first with linear aging, groups packed under Θ."""

from __future__ import annotations

import pytest

from batcher.policies import make_policy
from batcher.policies.spf import SPFPolicy
from tests.batcher.helpers import ctx, level, req


def test_shortest_predicted_goes_first_and_its_neighbours_ride_along():
    p = SPFPolicy(ctx(theta_tokens=100), aging=0.0)
    long_, mid, short, short2 = req(10, 80, 0.0), req(10, 30, 1.0), req(10, 5, 2.0), req(10, 6, 3.0)
    for r in (long_, mid, short, short2):
        p.add(r, r.arrival)
    b = p.pop(4.0)
    # key order short(5) short2(6) mid(30) long(80); static rule β·(L+G'): 3·(10+30)=120 > 100 stops at mid
    assert [r.id for r in b.requests] == [short.id, short2.id]
    assert [r.id for r in p.pop(4.0).requests] == [mid.id]
    assert [r.id for r in p.pop(4.0).requests] == [long_.id]
    assert p.pop(4.0) is None


def test_aging_lets_an_old_long_request_pass_newer_short_ones():
    p = SPFPolicy(ctx(theta_tokens=100), aging=10.0)
    old_long, new_short = req(10, 50, 0.0), req(10, 5, 10.0)   # keys 50 + 0 and 5 + 100
    p.add(old_long, 0.0)
    p.add(new_short, 10.0)
    assert p.pop(10.0).requests[0].id == old_long.id


def test_registered_and_validated():
    p = make_policy("spf", ctx(theta_tokens=100), threshold=1.0, spf_aging=2.0)
    p.add(req(10, 5), 0.0)
    assert p.pop(0.0).size == 1
    with pytest.raises(ValueError):
        SPFPolicy(ctx(theta_tokens=100), aging=-1.0)


def test_aging_comes_from_the_setting(monkeypatch):
    from cohort.settings import Settings

    monkeypatch.setenv("COHORT_SPF_AGING", "7.5")
    params = Settings().policy_params()
    p = level(make_policy("spf", ctx(theta_tokens=100), **params))
    assert isinstance(p, SPFPolicy) and p.aging == 7.5
