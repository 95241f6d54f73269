"""SLO-ODBS / SLO-DBS / ODBS on hand-built requests (LinearTime: T = 0.01 + 0.001·β·(L+G))."""

from __future__ import annotations

import random

import pytest

from batcher.policies import make_policy
from batcher.policies.slo import SLOODBSPolicy
from tests.batcher.helpers import ctx, level, req


def test_variants_set_the_weights():
    c = ctx()
    assert (level(make_policy("slo-dbs", c)).w1, level(make_policy("slo-dbs", c)).w2) == (1.0, 0.0)
    assert (level(make_policy("odbs", c)).w1, level(make_policy("odbs", c)).w2) == (0.0, 1.0)
    p = level(make_policy("slo-odbs", c, threshold=123.0, l1=7.0))  # Φ is not the SLO threshold
    assert (p.w1, p.w2, p.l1, p.l2, p.threshold) == (1.0, 1.0, 7.0, 1.2, 15000.0)


def test_pending_sorted_by_slo_then_predicted_length():
    p = level(make_policy("odbs", ctx(theta_tokens=40)))  # Θ holds one 20-token request... twice
    late, short, long_ = req(10, 10, 0.0, slo=50.0), req(10, 5, 1.0, slo=9.0), req(10, 9, 0.0, slo=10.0)
    for r in (late, long_, short):
        p.add(r, r.arrival)
    # deadlines: late 50, long_ 10, short 10 → short (G'=5) before long_ (G'=9)
    assert [e[3].id for e in p._pending] == [short.id, long_.id, late.id]
    b = p.pop(2.0)
    assert [r.id for r in b.requests] == [short.id, long_.id]


def test_odbs_closes_the_batch_on_length_mismatch():
    p = level(make_policy("odbs", ctx(), slo_threshold=100.0))
    a, b, c = req(10, 10, 0.0, slo=1.0), req(10, 12, 0.0, slo=2.0), req(10, 100, 0.0, slo=3.0)
    d = req(10, 11, 0.0, slo=4.0)
    for r in (a, b, c, d):
        p.add(r, 0.0)
    # b: |12−10|·2·1.2 = 4.8 ≤ 100 joins; c: |100−12|·3·1.2 = 316.8 > 100 closes the batch
    assert [r.id for r in p.pop(0.0).requests] == [a.id, b.id]
    # next pass starts at c; d: |11−100|·2·1.2 = 213.6 > 100 → c alone
    assert [r.id for r in p.pop(0.0).requests] == [c.id]
    assert [r.id for r in p.pop(0.0).requests] == [d.id]
    assert p.pop(0.0) is None


def test_slo_dbs_keeps_a_long_request_out_of_a_tight_batch():
    tight, big = req(10, 10, 0.0, slo=0.5), req(100, 900, 0.0, slo=100.0)
    # T̂(2, 100, 900) = 0.01 + 0.001·2·1000 = 2.01 s; tight overruns by 1.51 s, big by 0
    for name, expect in (("slo-dbs", 1), ("odbs", 2)):
        p = level(make_policy(name, ctx(), l1=10_000.0))   # T_l = 15100 > 15000 ; T_o = 890·2·1.2 = 2136
        p.add(tight, 0.0)
        p.add(big, 0.0)
        assert p.pop(0.0).size == expect, name
    t_l, t_o = SLOODBSPolicy(ctx(), l1=10_000.0).cost([tight], big, now=0.0)
    assert t_l == pytest.approx(10_000 * 1.51) and t_o == pytest.approx(2136.0)


def test_memory_cap_closes_the_batch():
    p = level(make_policy("slo-odbs", ctx(theta_tokens=60)))
    for i in range(4):
        p.add(req(10, 10, 0.0, slo=10.0 + i), 0.0)
    assert [p.pop(0.0).size, p.pop(0.0).size, p.pop(0.0)] == [3, 1, None]


def test_requeued_batch_runs_earliest_deadline_first():
    p = level(make_policy("slo-odbs", ctx(theta_tokens=20)))
    urgent, lax = req(10, 10, 0.0, slo=1.0), req(10, 10, 0.0, slo=100.0)
    p.add(urgent, 0.0)
    first = p.pop(0.0)
    p.add(lax, 0.5)
    p.requeue(first, 1.0)
    assert p.pop(1.0) is first
    assert p.pop(1.0).requests == [lax]


def test_requests_of_other_keys_are_skipped_not_closing():
    p = level(make_policy("slo-odbs", ctx()))
    a, other, b = req(10, 10, 0.0, slo=1.0), req(10, 10, 0.0, slo=2.0, model="other"), req(10, 10, 0.0, slo=3.0)
    for r in (a, other, b):
        p.add(r, 0.0)
    assert [r.id for r in p.pop(0.0).requests] == [a.id, b.id]
    assert p.pop(0.0).requests == [other]


def _literal_first_batch(p: SLOODBSPolicy, reqs, now):
    """The SPEC pass written out with the literal T_l/T_o (Σ over members each time)."""
    order = sorted(reqs, key=lambda r: (r.deadline, r.predicted_tokens))
    batch = [order[0]]
    for q in order[1:]:
        grown = batch + [q]
        L, G = max(r.input_tokens for r in grown), max(r.predicted_tokens for r in grown)
        if not p.ctx.memory.judge().fits(len(grown), L, G):
            break
        t_l, t_o = p.cost(batch, q, now)
        if p.w1 * t_l + p.w2 * t_o > p.threshold:
            break
        batch.append(q)
    return batch


@pytest.mark.parametrize("name", ["slo-odbs", "slo-dbs", "odbs"])
def test_prefix_sum_pass_matches_the_literal_formulas(name):
    rng = random.Random(7)
    for trial in range(40):
        p = level(make_policy(name, ctx(theta_tokens=3000), l1=rng.choice([1.0, 100.0, 3000.0])))
        reqs = [req(rng.randint(1, 60), rng.randint(1, 120), arrival=rng.uniform(0, 5),
                    slo=rng.uniform(0.05, 3.0)) for _ in range(rng.randint(1, 25))]
        for r in sorted(reqs, key=lambda r: r.arrival):
            p.add(r, r.arrival)
        now = 5.0
        expect = _literal_first_batch(p, reqs, now)
        got = p.pop(now)
        assert [r.id for r in got.requests] == [r.id for r in expect], trial
