"""The HELR search: exactness against brute force, modes, infeasibility, the thesis cluster."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

import numpy as np
import pytest

from deployer.cluster import GB
from deployer.helr import EXACT_LIMIT, solve
from deployer.helr_cost import MODES, DeploymentInfeasible, Plan, Problem, best_plan
from deployer.planner import plan_deployment
from deployer.topology import load_cluster


def random_problem(rng: np.random.Generator, n: int, **overrides) -> Problem:
    hop = rng.uniform(0.01, 2.0, (n, n))
    hop = (hop + hop.T) / 2
    np.fill_diagonal(hop, 0.0)
    kw = dict(
        mem=rng.integers(2, 12, n) * 1000,
        perf=rng.uniform(0.3, 1.0, n),
        hop=hop,
        num_layers=int(rng.integers(1, 30)),
        layer_bytes=700,
        first_bytes=int(rng.integers(0, 3)) * 500,
        last_bytes=int(rng.integers(0, 3)) * 500,
        kv_reserve=int(rng.integers(0, 2)) * 1000,
        first_read_bytes=0,
        last_read_bytes=int(rng.integers(0, 3)) * 400,
        return_hop=bool(rng.integers(0, 2)),
        p=0.001,
    )
    kw.update(overrides)
    return Problem(**kw)


def feasible_he_lr(seed: int, tries: int, max_devices: int) -> Iterator[tuple[Problem, Plan, Plan]]:
    """(problem, he plan, lr plan) for the random problems of 2..max_devices devices that have a plan."""
    rng = np.random.default_rng(seed)
    for _ in range(tries):
        prob = random_problem(rng, int(rng.integers(2, max_devices + 1)))
        try:
            yield prob, solve(prob, "he"), solve(prob, "lr")
        except DeploymentInfeasible:
            continue


def brute_force(problem: Problem, mode: str, a1: float, a2: float) -> Plan:
    """The oracle: every subset, every order (factorial; only for small n)."""
    orders = (list(o) for k in range(1, problem.n + 1)
              for subset in itertools.combinations(range(problem.n), k) for o in itertools.permutations(subset))
    plan = best_plan(problem, orders, mode, a1, a2)
    if plan is None:
        raise DeploymentInfeasible("no subset and order fits")
    return plan


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_dp_matches_brute_force(seed):
    """On small random instances the DP's optimum equals the search over all subsets and orders."""
    rng = np.random.default_rng(seed)
    checked = 0
    for _ in range(30):
        prob = random_problem(rng, int(rng.integers(1, 7)))
        for mode in MODES:
            try:
                brute = brute_force(prob, mode, a1=1.0, a2=0.7)
            except DeploymentInfeasible:
                with pytest.raises(DeploymentInfeasible):
                    solve(prob, mode, a1=1.0, a2=0.7)
                continue
            plan = solve(prob, mode, a1=1.0, a2=0.7)
            assert plan.size == brute.size, (mode, prob)
            assert plan.cost == pytest.approx(brute.cost, abs=1e-9), (mode, prob)
            assert plan.objective == pytest.approx(brute.objective, abs=1e-9)
            assert sum(plan.layers) == prob.num_layers
            checked += 1
    assert checked > 20


def test_plan_respects_memory_caps():
    rng = np.random.default_rng(7)
    for _ in range(50):
        prob = random_problem(rng, int(rng.integers(1, 7)))
        try:
            plan = solve(prob, "lr")
        except DeploymentInfeasible:
            continue
        for pos, used in zip(plan.order, plan.used_bytes, strict=True):
            assert used <= prob.mem[pos] - prob.kv_reserve


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_he_never_uses_more_devices_than_lr():
    seen_difference = False
    for _, he, lr in feasible_he_lr(seed=11, tries=120, max_devices=7):
        assert he.size <= lr.size
        assert lr.cost <= he.cost + 1e-12
        seen_difference |= he.size < lr.size
    assert seen_difference  # the modes really differ on some instances


def test_helr_weights_interpolate():
    for prob, he, lr in feasible_he_lr(seed=3, tries=40, max_devices=6):
        assert solve(prob, "helr", a1=1.0, a2=0.0).cost == pytest.approx(lr.cost)
        assert solve(prob, "helr", a1=1e-6, a2=1.0).size == he.size
        mid = solve(prob, "helr", a1=1.0, a2=1.0)
        assert he.size <= mid.size <= lr.size


def test_infeasible_message_says_need_vs_available():
    prob = Problem(mem=[4 * GB, 4 * GB], perf=[1.0, 1.0], hop=[[0, 0.1], [0.1, 0]], num_layers=10,
                   layer_bytes=1 * GB, kv_reserve=1 * GB)
    with pytest.raises(DeploymentInfeasible) as err:
        solve(prob, "helr")
    msg = str(err.value)
    assert isinstance(err.value, ValueError)
    assert "needs 10.00 GiB" in msg and "6.00 GiB usable" in msg


def test_whole_layers_granularity_is_infeasible():
    # total usable memory covers the bytes, but no layer split fits: 3 x 1.5 GiB per device
    prob = Problem(mem=[int(1.5 * GB)] * 3, perf=[1.0] * 3, hop=np.zeros((3, 3)), num_layers=4,
                   layer_bytes=1 * GB)
    with pytest.raises(DeploymentInfeasible):
        solve(prob, "lr")


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_exact_limit_is_fast_and_heuristic_is_feasible():
    rng = np.random.default_rng(5)
    prob = random_problem(rng, EXACT_LIMIT, mem=rng.integers(2, 6, EXACT_LIMIT) * 1000, num_layers=40,
                          kv_reserve=0)
    t0 = time.perf_counter()
    exact = solve(prob, "lr")
    assert time.perf_counter() - t0 < 10
    assert sum(exact.layers) == 40
    # heuristic above the limit: feasible, memory respected, never better than the optimum it misses
    big = random_problem(rng, EXACT_LIMIT + 4, num_layers=50, kv_reserve=0)
    plan = solve(big, "lr")
    assert sum(plan.layers) == 50 and len(set(plan.order)) == plan.size
    for pos, used in zip(plan.order, plan.used_bytes, strict=True):
        assert used <= big.mem[pos]


def test_thesis_cluster_with_6b_model(examples, shape_6b):
    """Thesis table 3-1 cluster (GPU0-1 PIX, GPU2-3 PIX, else NODE; 350/300/250/150 W)."""
    cluster = load_cluster(examples / "thesis_4gpu.yaml")
    # small reserve: the 13 GB model fits on the fastest GPU alone
    dep = plan_deployment(shape_6b, cluster, "lr", kv_reserve_bytes=2 * GB, baselines=False)
    assert dep.devices == [0]
    # 18 GiB reserve leaves 5.5 GiB per GPU: needs three; the slowest (150 W) GPU3 stays out
    for mode in MODES:
        dep = plan_deployment(shape_6b, cluster, mode, kv_reserve_bytes=18 * GB, baselines=False)
        assert sorted(dep.devices) == [0, 1, 2]
        layers = dict(zip(dep.devices, dep.plan.layers, strict=True))
        assert layers[0] >= layers[1] >= layers[2]  # faster devices get more layers
        pos = {d: i for i, d in enumerate(dep.devices)}
        assert abs(pos[0] - pos[1]) == 1  # the PIX pair sits next to each other in the pipeline
    # 20 GiB reserve: all four; both PIX pairs are adjacent, one NODE hop between them
    dep = plan_deployment(shape_6b, cluster, "helr", kv_reserve_bytes=20 * GB, baselines=False)
    order = dep.devices
    assert sorted(order) == [0, 1, 2, 3]
    assert {frozenset(order[:2]), frozenset(order[2:])} == {frozenset({0, 1}), frozenset({2, 3})}
    # too big a reserve: clear error
    with pytest.raises(DeploymentInfeasible, match="needs"):
        plan_deployment(shape_6b, cluster, "helr", kv_reserve_bytes=23 * GB, baselines=False)


def test_thesis_plan_beats_even_and_balanced(examples, shape_6b):
    cluster = load_cluster(examples / "thesis_4gpu.yaml")
    dep = plan_deployment(shape_6b, cluster, "helr", kv_reserve_bytes=18 * GB)
    even = dep.baselines["even"][1]
    assert even is not None and dep.predicted_cost < even.cost
    bal = dep.baselines["balanced"][1]
    if bal is not None:
        assert dep.predicted_cost <= bal.cost
    # the reported cost of the map equals the planner's own cost
    assert dep.predicted_cost == pytest.approx(dep.plan.cost)
