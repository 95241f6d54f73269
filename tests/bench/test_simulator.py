"""Simulator: conservation, the OOM split path, oracle ≥ predictions, Magnus beats VS under load."""

from __future__ import annotations

import pytest

from batcher.memory import KVMemory
from bench.metrics import METRICS
from bench.roofline import instance
from bench.simulator import parse_policy, simulate
from tests.bench.helpers import TIGHT, TIGHT_RUN, StepTime, bimodal, mk, under_predicted

MEM = KVMemory(delta_bytes=1, theta_bytes=12_000)   # Θ in tokens


def test_policy_names_parse():
    assert parse_policy("magnus") == ("magnus", False)
    assert parse_policy("slo-odbs+oracle") == ("slo-odbs", True)
    with pytest.raises(ValueError):
        parse_policy("magnus+foo")


@pytest.mark.parametrize("name", ["vs", "glp", "abp", "magnus", "s3", "slo-dbs", "odbs", "slo-odbs", "spf"])
def test_every_policy_conserves_requests(name):
    reqs = bimodal(600, rate=20.0, noise=0.5)
    r = simulate(reqs, name, MEM, StepTime(), instances=3, max_input_tokens=50, max_tokens_limit=250,
                 params={"threshold": 5000.0})
    m = r.metrics
    assert set(m) == set(METRICS)
    assert m["completed"] + m["failed"] == len(reqs)
    assert m["completed"] == len(reqs)
    assert 0 < m["slo_attainment"] <= 1 and m["mean_latency_s"] > 0
    assert m["p50_latency_s"] <= m["p99_latency_s"]
    assert m["valid_token_throughput"] <= m["total_token_throughput"] + 1e-9


def test_oom_splits_halves_and_fails_what_cannot_fit():
    mem = KVMemory(delta_bytes=1, theta_bytes=1000)
    # predicted 10 tokens each, truly 300: 4 × (10 + 300) > 1000 → OOM → halves of 2 (620 fits)
    reqs = [mk(i, 10, 300, pred=10) for i in range(4)]
    # and one request that cannot fit even alone: 10 + 2000 > 1000
    reqs.append(mk(9, 10, 2000, pred=10, t=0.0))
    r = simulate(reqs, "abp", mem, StepTime(), instances=1, params={"threshold": 1e12})
    m = r.metrics
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["completed"] + m["failed"] == len(reqs)
    # first batch of 5 OOMs → 3 + 2; the 3 (with the big one, 3·(10+2000)) OOMs → 2 + 1;
    # ... every split is counted, the lone big request fails instead of looping
    assert m["oom_splits"] >= 2
    assert m["slo_attainment"] <= 0.8


def test_vs_never_runs_out_of_memory_with_worst_case_size():
    reqs = bimodal(300, rate=50.0, noise=0.9)
    r = simulate(reqs, "vs", MEM, StepTime(), instances=2, max_input_tokens=50, max_tokens_limit=250)
    assert r.metrics["oom_splits"] == 0 and r.metrics["mean_batch_size"] <= 12_000 // 300


def test_oracle_at_least_as_good_as_noisy_predictions():
    noisy = bimodal(1500, rate=60.0, seed=4, noise=0.6)
    oracle = [mk(i, r.input_tokens, r.true_tokens, None, r.arrival) for i, r in enumerate(noisy)]
    kw = dict(instances=2, max_input_tokens=50, max_tokens_limit=250, params={"threshold": 5000.0})
    p = simulate(noisy, "magnus", MEM, StepTime(), **kw).metrics
    o = simulate(oracle, "magnus+oracle", MEM, StepTime(), **kw).metrics
    assert o["request_throughput"] >= 0.98 * p["request_throughput"]
    assert o["total_wma"] <= p["total_wma"]


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_magnus_beats_vs_under_load():
    """On the default testbed (ChatGLM-6B/V100 roofline), at twice VS's capacity."""
    inst = instance()
    reqs = bimodal(3000, rate=20.0, seed=1, noise=0.2)
    kw = dict(instances=4, max_input_tokens=1024, max_tokens_limit=1024, params={"threshold": 20_000.0})
    vs = simulate(reqs, "vs", inst.memory, inst.time_model(), **kw).metrics
    mg = simulate(reqs, "magnus", inst.memory, inst.time_model(), **kw).metrics
    assert mg["request_throughput"] > 1.5 * vs["request_throughput"]
    assert mg["mean_latency_s"] < 0.5 * vs["mean_latency_s"]
    assert mg["total_wma"] < vs["total_wma"]


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_default_testbed_runs_a_real_trace(tiny_files, tiny_rows):
    from bench.workload import WorkloadConfig, make_workload

    inst = instance()
    tm = inst.time_model()
    w = make_workload(WorkloadConfig(files=tiny_files, requests=3000, rate=40.0, seed=2), tm, tiny_rows)
    res = {}
    for name in ("vs", "magnus+oracle"):
        res[name] = simulate(w.requests(oracle=True), name, inst.memory, tm, instances=8,
                             max_input_tokens=1024, max_tokens_limit=1024, params={"threshold": 20_000.0})
        assert res[name].metrics["completed"] == 3000
    assert res["magnus+oracle"].metrics["request_throughput"] > res["vs"].metrics["request_throughput"]


def test_headroom_cuts_ooms_from_under_predictions_but_not_vs():
    reqs, mem, kw = under_predicted(400, seed=9, lo=0.7, hi=1.1), TIGHT, TIGHT_RUN
    tight = simulate(reqs, "abp", mem, StepTime(), **kw).metrics
    slack = simulate(reqs, "abp", mem, StepTime(), headroom=0.3, **kw).metrics
    assert slack["oom_splits"] < tight["oom_splits"]
    assert slack["completed"] + slack["failed"] == 400
    a = simulate(reqs, "vs", mem, StepTime(), **kw).metrics
    b = simulate(reqs, "vs", mem, StepTime(), headroom=0.3, **kw).metrics
    assert a == b
