"""Elastic execution in the simulator: own finish times, the shrinking-β time formula, preemption
that keeps progress, and split mode reproducing the static simulator."""

from __future__ import annotations

import pytest

from batcher.memory import KVMemory
from bench.execution import simulate_batch_run
from bench.simulator import parse_run, simulate
from tests.bench.helpers import TIGHT, TIGHT_RUN, StepTime, bimodal, mk, under_predicted


class StepCost:
    """T(β, L, G) = 1 + Σ_{g=1..G} β·(L+g)·0.001 + G·0.01: per-step cost grows with the KV read."""

    def estimate(self, size, input_len, gen_len):
        G = gen_len
        return 1.0 + 0.001 * size * (input_len * G + G * (G + 1) / 2) + 0.01 * G

    def estimate_many(self, shapes):
        return [self.estimate(*s) for s in shapes]


def brute_force_elastic(L, true, tm):
    """Step by step: each step costs the model's step cost with the rows alive at that step."""
    t = tm.estimate(len(true), L, 0)
    finish = {}
    for g in range(1, max(true) + 1):
        alive = sum(1 for x in true if x >= g)
        t += tm.estimate(alive, L, g) - tm.estimate(alive, L, g - 1)
        for i, x in enumerate(true):
            if x == g:
                finish[i] = t
    return finish, t


def test_elastic_rows_finish_at_their_own_length_with_the_alive_beta_cost():
    tm = StepCost()
    true = [3, 10, 7, 10, 1]
    run = simulate_batch_run([5, 8, 2, 8, 4], true, true, [0] * 5, 10**9, tm, "elastic", "preempt")
    want, end = brute_force_elastic(8, true, tm)
    got = dict(run.finished)
    assert set(got) == set(range(5))
    for i in range(5):
        assert got[i] == pytest.approx(want[i])
    assert run.end == pytest.approx(end)
    assert got[4] < got[0] < got[2] < got[1] == got[3]
    assert run.decoded == sum(true) and run.wasted == 0
    assert run.first_token == pytest.approx(tm.estimate(5, 8, 1))


def test_static_rows_finish_with_the_batch():
    tm = StepCost()
    run = simulate_batch_run([5, 8], [3, 10], [3, 10], [0, 0], 10**9, tm, "static", "split")
    assert dict(run.finished) == {0: tm.estimate(2, 8, 10), 1: tm.estimate(2, 8, 10)}
    assert run.end == tm.estimate(2, 8, 10) and run.decoded == 20


def test_preemption_evicts_the_longest_predicted_remaining_and_keeps_its_tokens():
    tm = StepCost()
    # L = 10, three rows; budget 40 tokens: 3·(10+s) passes 40 at s = 4 → evict until it fits
    run = simulate_batch_run([10, 10, 10], [20, 5, 20], [6, 5, 30], [0, 0, 0], 40, tm, "elastic", "preempt")
    assert [(i, kept) for i, kept, _ in run.evicted][0] == (2, 3)   # largest predicted remaining first
    evicted = {i for i, _, _ in run.evicted}
    finished = {i for i, _ in run.finished}
    assert evicted | finished == {0, 1, 2} and not run.failed and run.split is None
    for _, kept, _ in run.evicted:
        assert kept >= 1                    # progress kept, never a restart from zero


def test_a_row_that_cannot_step_even_alone_fails():
    run = simulate_batch_run([30], [50], [5], [0], 40, StepTime(), "elastic", "preempt")
    assert [i for i, _ in run.failed] == [0] and not run.evicted and not run.finished


def test_split_mode_throws_the_run_away():
    run = simulate_batch_run([10, 10, 10], [20, 5, 20], [6, 5, 30], [0, 0, 0], 40, StepCost(), "static", "split")
    assert run.split == [0, 1, 2] and not run.finished and run.wasted == run.decoded > 0


def test_run_names_expand_over_execution_modes():
    assert parse_run("magnus", ("static", "elastic")) == [("magnus@static", "static", "split"),
                                                         ("magnus@elastic", "elastic", "preempt")]
    assert parse_run("magnus+oracle@elastic/split") == [("magnus+oracle@elastic/split", "elastic", "split")]
    assert parse_run("vs", ("static",), "preempt") == [("vs@static/preempt", "static", "preempt")]
    with pytest.raises(ValueError):
        parse_run("vs@turbo")


def test_simulated_latency_ends_at_the_request_own_length_not_its_batch():
    tm = StepCost()
    # the first request takes the only instance; the next two wait and then share one batch
    reqs = [mk(9, 10, 1), mk(0, 10, 2), mk(1, 10, 40)]
    kw = dict(instances=1, params={"threshold": 1e12})
    mem = KVMemory(1, 10**6)
    el = simulate(reqs, "abp", mem, tm, execution="elastic", oom_recovery="preempt", **kw)
    st = simulate(reqs, "abp", mem, tm, **kw)
    assert el.batches == st.batches == 2
    t_b = tm.estimate(1, 10, 1)
    want, _ = brute_force_elastic(10, [2, 40], tm)
    assert el.metrics["mean_latency_s"] == pytest.approx((3 * t_b + want[0] + want[1]) / 3)
    assert st.metrics["mean_latency_s"] == pytest.approx((3 * t_b + 2 * tm.estimate(2, 10, 40)) / 3)
    assert el.metrics["p50_latency_s"] == pytest.approx(t_b + want[0])   # answered after its 2 tokens
    assert st.metrics["p50_latency_s"] == pytest.approx(t_b + tm.estimate(2, 10, 40))
    assert el.metrics["mean_ttft_s"] == pytest.approx((tm.estimate(1, 10, 1) + 2 * (t_b + tm.estimate(2, 10, 1))) / 3)


def test_preemption_keeps_progress_and_conserves_requests():
    """Under-predicted lengths overflow memory; preempted rows resume as continuations."""
    reqs, mem, kw = under_predicted(300, seed=5, lo=0.3, hi=0.8), TIGHT, TIGHT_RUN
    pre = simulate(reqs, "abp", mem, StepTime(), execution="elastic", oom_recovery="preempt", **kw).metrics
    spl = simulate(reqs, "abp", mem, StepTime(), execution="elastic", oom_recovery="split", **kw).metrics
    assert pre["completed"] + pre["failed"] == 300 and pre["failed"] == 0
    assert pre["preemptions"] > 0 and pre["oom_splits"] == 0
    assert pre["wasted_tokens"] == 0 and pre["recomputed_tokens"] > 0
    assert spl["oom_splits"] > 0 and spl["wasted_tokens"] > 0 and spl["preemptions"] == 0
    assert pre["request_throughput"] > spl["request_throughput"]
    # every token of every request is generated once: nothing restarted from zero
    assert pre["valid_token_throughput"] == pytest.approx(pre["total_token_throughput"])


def test_static_split_is_the_default_and_matches_naming_it():
    reqs, mem, kw = under_predicted(400, seed=9, lo=0.7, hi=1.1), TIGHT, TIGHT_RUN
    a = simulate(reqs, "magnus", mem, StepTime(), **kw).metrics
    b = simulate(reqs, "magnus", mem, StepTime(), execution="static", oom_recovery="split", **kw).metrics
    assert a == b and a["oom_splits"] > 0 and a["preemptions"] == 0


@pytest.mark.parametrize("name", ["vs", "glp", "abp", "magnus", "s3", "s3-hrrn", "slo-odbs"])
@pytest.mark.parametrize("mode", [("elastic", "preempt"), ("elastic", "split"), ("static", "preempt")])
def test_every_policy_and_mode_conserves_requests(name, mode):
    reqs = bimodal(400, rate=30.0, noise=0.6)
    mem = KVMemory(delta_bytes=1, theta_bytes=6000)
    m = simulate(reqs, name, mem, StepTime(), instances=2, max_input_tokens=50, max_tokens_limit=250,
                 params={"threshold": 5000.0}, execution=mode[0], oom_recovery=mode[1]).metrics
    assert m["completed"] + m["failed"] == 400 and m["completed"] == 400
    assert m["mean_ttft_s"] <= m["mean_latency_s"]
