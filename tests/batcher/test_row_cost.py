"""The marginal-cost rule (``batcher.row_cost``): a row joins while it pays for itself on the
step, and a worker's step cost learnt from its own steps."""

from __future__ import annotations

import random

import pytest

from batcher.kv_judge import KVJudge
from batcher.row_cost import OnlineStepCost, row_pays


class LinearCost:
    """seconds = a + b·rows + c·context tokens."""

    def __init__(self, a: float, b: float, c: float = 0.0) -> None:
        self.a, self.b, self.c = a, b, c

    def decode_seconds(self, rows: int, context_tokens: float) -> float:
        return self.a + self.b * rows + self.c * context_tokens


def test_a_row_pays_while_its_marginal_cost_stays_under_the_share_of_the_mean():
    cost = LinearCost(10.0, 1.0)
    # marginal 1, mean per row (10 + n) / n: 1·n ≤ 0.5·(10 + n) holds up to n = 10
    assert row_pays(cost, 10, 0, 0.5)
    assert not row_pays(cost, 11, 0, 0.5)
    assert row_pays(cost, 11, 0, 0.0)          # 0: the rule is off
    assert row_pays(None, 1000, 0, 0.5)        # no cost known yet: it does not bind
    assert row_pays(cost, 1, 10 ** 9, 0.01)    # one row always runs


def test_context_counts_at_the_sets_mean_not_the_joiners_own():
    """The rule caps how many rows run; it does not rank rows by their prompts."""
    cost = LinearCost(10.0, 0.0, 0.01)
    # 20 rows at 50 tokens each: marginal 0.5, step 20: 20 · 0.5 = 10 ≤ 0.5 · 20
    assert row_pays(cost, 20, 1000, 0.5)
    assert not row_pays(cost, 21, 1050 + 10, 0.5)
    assert KVJudge(10 ** 6, 16, 256, 0.5).running_set_fits([50] * 20, [1] * 20, cost)
    assert not KVJudge(10 ** 6, 16, 256, 0.5).running_set_fits([50] * 21, [1] * 21, cost)


def test_online_step_cost_learns_the_steps_terms():
    rng = random.Random(0)
    est = OnlineStepCost(min_steps=64)
    assert est.decode_seconds(10, 1000) is None
    for k in range(400):
        rows = rng.randint(1, 200)
        prefill = rng.choice([0, 0, rng.randint(16, 512)])   # most steps only decode
        kv = rows * rng.randint(50, 800) + prefill * rng.randint(1, 400)
        true = 0.002 + 1e-4 * rows + 2e-5 * prefill + 2e-7 * kv
        est.observe(rows, prefill, kv, true * rng.uniform(0.98, 1.02))
        if k == 62:
            assert est.coefficients is None     # not before min_steps
    a, b, p, c = est.coefficients
    assert a == pytest.approx(0.002, rel=0.15)
    assert b == pytest.approx(1e-4, rel=0.1)
    assert p == pytest.approx(2e-5, rel=0.1)
    assert c == pytest.approx(2e-7, rel=0.1)
    assert est.decode_seconds(64, 64 * 400) == pytest.approx(0.002 + 64e-4 + 2e-7 * 64 * 400, rel=0.05)


def test_online_step_cost_ignores_empty_steps_and_survives_steps_that_never_vary():
    est = OnlineStepCost(min_steps=8, refit=1)
    est.observe(0, 0, 0, 0.01)                  # nothing ran
    est.observe(5, 0, 100, 0.0)                 # no time measured
    assert est.steps == 0
    for _ in range(50):
        est.observe(4, 0, 400, 0.003)           # one shape only: the terms cannot be told apart
    got = est.decode_seconds(4, 400)
    assert got is None or got == pytest.approx(0.003, rel=0.05)


def test_a_cost_learnt_from_one_row_at_a_time_does_not_cap_rows():
    """With the decode rows never varying the fixed and per-row parts cannot be told apart: no
    fit, so the rule does not bind on a guess; a spread of row counts gives one."""
    rng = random.Random(1)
    est = OnlineStepCost(min_steps=16, refit=1)
    for _ in range(300):
        est.observe(1, rng.choice([0, 64]), rng.randint(10, 400), 0.003 * rng.uniform(0.98, 1.02))
    assert est.row_spread() < 1 and est.coefficients is None
    assert row_pays(est, 5, 500, 0.815)
    for _ in range(300):
        rows = rng.randint(1, 64)
        est.observe(rows, 0, rows * 100, 0.002 + 1e-4 * rows)
    assert est.row_spread() > 2 and est.coefficients is not None


def test_a_fit_without_a_fixed_part_is_not_trusted():
    """Steps proportional to their rows would let no second row join: not a fit to act on."""
    est = OnlineStepCost(min_steps=16, refit=1)
    for rows in list(range(1, 40)) * 4:
        est.observe(rows, 0, rows * 50, 1e-4 * rows)
    assert est.coefficients is None and row_pays(est, 2, 100, 0.815)
