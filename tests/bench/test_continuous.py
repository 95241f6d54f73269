"""The continuous simulator: conservation, the policy's order reaching the engine, swap vs
recompute vs adaptive preemption, adaptive-fair (AdaptiveLLM Algorithm 2), the physical bound."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from batcher.memory import KVMemory
from batcher.preemption import SwapLink
from bench.continuous import EngineLimits, SimInstance, SimRow
from bench.continuous_sched import AdaptiveFairScheduler, FCFSScheduler, fair_priority
from bench.roofline import instance
from bench.simulator import parse_run, simulate
from tests.bench.helpers import mk

INST = instance("a800-80gb", "llama-13b")
TM = INST.time_model()
DELTA = INST.model.delta_bytes


def mem(tokens: int) -> KVMemory:
    return KVMemory(DELTA, tokens * DELTA)


def trace(n: int, rate: float, seed: int = 0, long_frac: float = 0.3, noise: float = 0.0) -> list:
    """Short (4–30 tokens) and long (100–300) answers, prompts of 20–200 tokens, Poisson arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        g = rng.randint(100, 300) if rng.random() < long_frac else rng.randint(4, 30)
        pred = max(1, round(g * (1 + rng.uniform(-noise, noise))))
        out.append(mk(i, rng.randint(20, 200), g, pred, t))
    return out


def run(reqs, policy, tokens=4096, instances=1, **kw):
    return simulate(reqs, policy, mem(tokens), TM, instances=instances, execution="continuous",
                    oom_recovery="preempt", max_input_tokens=256, max_tokens_limit=512, **kw)


@pytest.mark.parametrize("policy", ["cb-fcfs", "adaptive-fair", "spf", "magnus", "s3-hrrn", "vs"])
@pytest.mark.parametrize("mode", ["recompute", "swap", "adaptive"])
@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_every_request_is_answered_once_under_memory_pressure(policy, mode):
    reqs = trace(300, rate=200.0, noise=0.5)
    r = run(reqs, policy, tokens=2048, preemption=mode, link=INST.swap_link(), host_pages=32)
    m = r.metrics
    assert m["completed"] == len(reqs) and m["failed"] == 0
    assert m["preemptions"] == m["swaps"] + m["recomputes"]
    assert m["weighted_turnaround"] >= 1.0
    assert r.extra["physical_bound_rps"] >= m["request_throughput"] * 0.999
    if mode == "recompute":
        assert m["swaps"] == 0


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_the_policy_order_reaches_the_engine():
    """With a queue, shortest-predicted-first admission beats FCFS on mean latency and TTFT, and the
    results differ (the first cut ran every policy identically)."""
    reqs = trace(600, rate=400.0, long_frac=0.3)
    fcfs = run(reqs, "cb-fcfs", instances=2).metrics
    spf = run(reqs, "spf", instances=2, params={"spf_aging": 0.0}).metrics
    assert spf["mean_ttft_s"] < 0.8 * fcfs["mean_ttft_s"]
    assert spf["mean_latency_s"] < fcfs["mean_latency_s"]


def test_swap_keeps_tokens_and_recompute_drops_them():
    reqs = trace(200, rate=500.0, long_frac=0.6)
    rec = run(reqs, "cb-fcfs", tokens=2048, preemption="recompute").metrics
    swp = run(reqs, "cb-fcfs", tokens=2048, preemption="swap", link=INST.swap_link(), host_pages=10_000).metrics
    assert rec["recomputes"] > 0 and rec["recomputed_tokens"] > 0
    assert swp["swaps"] > 0 and swp["recomputes"] == 0 and swp["recomputed_tokens"] == 0
    none = run(reqs, "cb-fcfs", tokens=2048, preemption="swap", link=INST.swap_link(), host_pages=0).metrics
    assert none["swaps"] == 0 and none["recomputes"] > 0     # no host room: swap mode can only recompute


def test_adaptive_swaps_only_when_the_link_makes_it_cheaper():
    reqs = trace(200, rate=500.0, long_frac=0.6)
    fast = run(reqs, "cb-fcfs", tokens=2048, preemption="adaptive", link=SwapLink(1e15, 1e15),
               host_pages=10_000).metrics
    slow = run(reqs, "cb-fcfs", tokens=2048, preemption="adaptive", link=SwapLink(1e3, 1e3),
               host_pages=10_000).metrics
    # a free link beats any recompute that costs anything (a re-prefill hidden under a memory-bound
    # step costs nothing, and a row still prefilling is never swapped); a slow one never does
    assert fast["swaps"] > 0
    assert slow["swaps"] == 0 and slow["recomputes"] > 0


def test_swap_needs_a_link():
    with pytest.raises(ValueError):
        run(trace(10, 10.0), "cb-fcfs", preemption="swap")


def test_engine_schedulers_run_only_continuous():
    assert parse_run("adaptive-fair") == [("adaptive-fair", "continuous", "preempt")]
    with pytest.raises(ValueError):
        parse_run("adaptive-fair@elastic")


def _row(j, L, kv, arrival, order):
    r = SimRow(j, replace(mk(j, L, 50), arrival=arrival), order)
    r.filled = r.prompt
    r.kv = kv
    return r


def test_adaptive_fair_ranks_by_wait_over_tokens():
    assert fair_priority(0.0, 100, 10.0) == pytest.approx(0.1)
    assert fair_priority(5.0, 10, 1.0) == 0.0
    lim = EngineLimits()
    s = AdaptiveFairScheduler(lim)
    rows = [_row(0, 10, 10, 0.0, 1), _row(1, 10, 400, 0.0, 2), _row(2, 10, 40, 1.0, 3)]
    assert s.victim(rows, 0, 2.0) == 1                       # the lowest P: the most tokens for its wait
    assert FCFSScheduler(lim).victim(rows, 0, 2.0) == 2      # vLLM: the newest


def test_adaptive_fair_picks_the_queue_with_the_higher_mean_priority():
    lim = EngineLimits()
    inst = SimInstance(pages=100, limits=lim)
    inst.swapped = [_row(0, 10, 160, 0.0, 1)]                 # P at t=10: 10 / 160
    s = AdaptiveFairScheduler(lim)
    assert s.swap_in_first(inst, 10.0)                        # nothing waits
    s.add(mk(1, 16, 5, t=9.0), 9.0)                           # P at t=10: 1 / 16, lower
    assert s.swap_in_first(inst, 10.0)
    s.add(mk(2, 16, 5, t=0.0), 0.0)                           # P at t=10: 10 / 16: the waiting mean wins
    assert not s.swap_in_first(inst, 10.0)
    assert s.admit(inst, 10.0, 8192)[0].id == "q2"            # highest P joins first


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_the_row_cap_binds_cohort_policies_not_the_baseline():
    """``max_rows`` (COHORT_CONTINUOUS__MAX_ROWS) is cohort's own cap: its instances never run more
    rows at once; cb-fcfs keeps vLLM's max_num_seqs, and every request is still answered."""
    reqs = trace(300, rate=400.0, long_frac=0.3)
    capped = run(reqs, "spf", max_rows=4)
    free = run(reqs, "spf", max_rows=256)
    cb = run(reqs, "cb-fcfs", max_rows=4)
    assert capped.extra["limits"]["max_num_seqs"] == 4 and cb.extra["limits"]["max_num_seqs"] == 256
    assert capped.metrics["mean_batch_size"] <= 4 < free.metrics["mean_batch_size"]
    assert cb.metrics["mean_batch_size"] > 4
    assert capped.metrics["completed"] == free.metrics["completed"] == len(reqs)
    # the cap is a scheduling choice: the physical bound stays the engine's, the same for every policy
    assert capped.extra["physical_bound_rps"] == cb.extra["physical_bound_rps"]


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_the_marginal_cost_rule_binds_cohort_policies_not_the_baseline():
    """COHORT_CONTINUOUS__MARGINAL_COST: on a step bound by the rows themselves a cohort policy's
    instance stops admitting rows that no longer pay for themselves; cb-fcfs has no such rule, and
    every request is still answered."""
    reqs = trace(1500, rate=3000.0, long_frac=0.5)
    held = run(reqs, "spf", tokens=400_000, marginal_cost=0.5)
    free = run(reqs, "spf", tokens=400_000, marginal_cost=0.0)
    cb = run(reqs, "cb-fcfs", tokens=400_000, marginal_cost=0.5)
    cb_free = run(reqs, "cb-fcfs", tokens=400_000, marginal_cost=0.0)
    assert held.metrics["mean_batch_size"] < 0.9 * free.metrics["mean_batch_size"]
    assert cb.metrics["mean_batch_size"] == cb_free.metrics["mean_batch_size"]
    assert held.metrics["completed"] == free.metrics["completed"] == len(reqs)


@pytest.mark.parametrize(("gpu", "model", "binds"), [("v100-32gb", "chatglm-6b", True),
                                                      ("h100-80gb", "llama-7b", False)])
def test_the_default_marginal_cost_binds_where_the_rows_bound_the_step(gpu, model, binds):
    """The documented behaviour of the default (docs/notes/benchmarks.md): 256 rows of 150 tokens
    pay for themselves on H100 / Llama-7B (a step's fixed part dominates) but not on V100 /
    ChatGLM-6B (compute-bound), where the rule lets in about 223."""
    from batcher.row_cost import row_pays
    from bench.continuous_run import DEFAULT_MARGINAL_COST

    tm = instance(gpu, model).time_model()
    assert row_pays(tm, 256, 256 * 150, DEFAULT_MARGINAL_COST) is not binds
    assert row_pays(tm, 200, 200 * 150, DEFAULT_MARGINAL_COST)


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_step_cost_learnt_from_the_steps_binds_as_the_roofline_does():
    """``learnt_step_cost``: the rule priced on ``OnlineStepCost`` fed by the simulated steps (a
    live worker's way) holds the running set back as the roofline's own cost does."""
    reqs = trace(1500, rate=3000.0, long_frac=0.5)
    roofline = run(reqs, "spf", tokens=400_000, marginal_cost=0.5)
    learnt = run(reqs, "spf", tokens=400_000, marginal_cost=0.5, learnt_step_cost=True)
    free = run(reqs, "spf", tokens=400_000, marginal_cost=0.0, learnt_step_cost=True)
    assert learnt.extra["step_cost"] == "learnt" and roofline.extra["step_cost"] == "roofline"
    assert learnt.metrics["mean_batch_size"] < 0.9 * free.metrics["mean_batch_size"]
    assert learnt.metrics["mean_batch_size"] == pytest.approx(roofline.metrics["mean_batch_size"], rel=0.1)
    assert learnt.metrics["completed"] == len(reqs)
