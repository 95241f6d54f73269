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


def _prefixed(L_ids: list[int], G: int, arrival: float = 0.0):
    r = req(len(L_ids), G, arrival)
    r.prompt_ids = list(L_ids)
    return r


def _paged_ctx(theta_tokens: int, page: int = 4):
    c = ctx(theta_tokens=theta_tokens)
    c.prefix_page_tokens = page
    return c


SYSTEM = list(range(100, 108))  # two pages of 4 tokens


def test_a_request_sharing_the_heads_prompt_joins_its_group_ahead_of_its_turn():
    p = SPFPolicy(_paged_ctx(theta_tokens=60), aging=0.0, prefix_window=10)
    head = _prefixed(SYSTEM + [1, 2, 3, 4], 5)
    other = _prefixed(list(range(200, 212)), 6)          # next in key order, another prompt
    mate = _prefixed(SYSTEM + [9, 9, 9, 9], 9)           # same system prompt, 4 tokens of rank behind the head
    far = _prefixed(SYSTEM + [7, 7, 7, 7], 40)           # same system prompt, 35 behind: outside the window
    for r in (head, other, mate, far):
        p.add(r, 0.0)
    # static rule β·(L(B)+G'): head+mate = 2·(12+9) = 42 <= 60; a third row (3·(12+9) = 63) does not fit
    assert [r.id for r in p.pop(0.0).requests] == [head.id, mate.id]
    assert [r.id for r in p.pop(0.0).requests] == [other.id]
    assert [r.id for r in p.pop(0.0).requests] == [far.id]
    assert p.pop(0.0) is None


def test_a_member_is_planned_with_the_part_of_its_prompt_the_group_does_not_hold():
    turn1 = _prefixed(SYSTEM + [1, 2, 3, 4], 4)                     # 12 tokens, 3 pages
    turn3 = _prefixed(SYSTEM + [1, 2, 3, 4] + list(range(300, 328)), 4)  # 40 tokens: 12 shared, 28 its own
    # whole prompts: 2·(40+4) = 88 > 70; with the shared pages counted once: 2·(28+4) = 64 <= 70
    p = SPFPolicy(_paged_ctx(theta_tokens=70), aging=0.0, prefix_window=10)
    p.add(turn1, 0.0)
    p.add(turn3, 0.0)
    assert [r.id for r in p.pop(0.0).requests] == [turn1.id, turn3.id]
    unpaged = SPFPolicy(ctx(theta_tokens=70), aging=0.0, prefix_window=10)  # no prefix cache: prompts share nothing
    unpaged.add(turn1, 0.0)
    unpaged.add(turn3, 0.0)
    assert unpaged.pop(0.0).size == 1 and unpaged.pop(0.0).size == 1


def test_prefix_grouping_takes_every_request_exactly_once():
    p = SPFPolicy(_paged_ctx(theta_tokens=80), aging=1.0, prefix_window=20)
    firsts = [SYSTEM, list(range(50, 58)), None]  # two shared prompts, and prompts of their own
    rs = [_prefixed((firsts[i % 3] or list(range(1000 + 8 * i, 1008 + 8 * i))) + [i] * 4, 3 + (i * 7) % 30, float(i))
          for i in range(40)]
    for r in rs:
        p.add(r, r.arrival)
    seen = []
    while (b := p.pop(50.0)) is not None:
        seen += [r.id for r in b.requests]
    assert sorted(seen) == sorted(r.id for r in rs)
    assert p.pop(50.0) is None
    assert p._by_first_page == {}  # nothing kept once taken, however it was taken


def test_the_prefix_window_comes_from_the_setting(monkeypatch):
    from cohort.settings import Settings

    monkeypatch.setenv("COHORT_SPF_PREFIX_WINDOW", "12")
    p = make_policy("spf", ctx(theta_tokens=100), **Settings().policy_params())
    assert level(p).prefix_window == 12.0
    with pytest.raises(ValueError):
        SPFPolicy(ctx(theta_tokens=100), prefix_window=-1.0)


def test_a_request_is_planned_without_what_the_instance_it_would_go_to_holds():
    c = ctx(theta_tokens=40)
    c.prefix_page_tokens = 4
    c.cached_tokens = lambda r: 8 if r.prompt_ids[:8] == SYSTEM else 0   # the routed-to instance holds SYSTEM
    a = _prefixed(SYSTEM + list(range(10, 22)), 4)      # 20 tokens, 8 of them held there
    twin = _prefixed(SYSTEM + list(range(30, 42)), 5)   # 20 tokens, the same 8 held
    stranger = _prefixed(list(range(60, 80)), 4)        # 20 tokens, nothing held
    p = SPFPolicy(c, aging=0.0, prefix_window=0)
    for r in (a, twin):
        p.add(r, 0.0)
    # static rule β·(L(B)+G'): each planned as 12 tokens, 2·(12+5) = 34 <= 40 (whole prompts: 2·(20+5) = 50)
    assert [r.id for r in p.pop(0.0).requests] == [a.id, twin.id]
    c.cached_tokens = None  # nothing known of the instances: the head is planned whole, 2·(20+5) = 50 > 40
    p = SPFPolicy(c, aging=0.0, prefix_window=0)
    for r in (a, twin, stranger):
        p.add(r, 0.0)
    assert [p.pop(0.0).size for _ in range(3)] == [1, 1, 1]
