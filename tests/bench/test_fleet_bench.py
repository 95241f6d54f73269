"""The fleet benchmark's pure parts: the direct client's routing, the time scaling under
``--speedup``, the summary's percentiles and goodput, the engines' counters, ratios and targets."""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace

import numpy as np
import pytest

from bench.fleet_bench import (
    EngineSpec,
    Router,
    check_targets,
    direct_target,
    engine_totals,
    parse_metrics,
    ratios_to,
    saturated_rps,
    spread,
    summary,
    to_model,
    to_wall,
)
from bench.fleet_cli import labels
from bench.upstream_bench import StreamResult


def test_round_robin_goes_in_turn_whatever_is_in_flight():
    r = Router("rr", 3)
    assert [r.pick() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    r.done(1)
    assert r.in_flight == [3, 1, 2]


def test_least_loaded_takes_the_emptiest_engine_ties_in_turn():
    r = Router("ll", 3)
    assert [r.pick() for _ in range(3)] == [0, 1, 2]   # an idle fleet fills evenly
    r.done(1)
    assert r.pick() == 1                                 # the one with nothing in flight
    r.done(0)
    r.done(2)
    assert r.in_flight == [0, 1, 0]
    assert r.pick() == 2 and r.pick() == 0               # ties in round-robin order after the last pick
    with pytest.raises(ValueError):
        Router("random", 2)


def test_direct_targets_and_labels():
    assert direct_target("rr-fcfs") == ("rr", "fcfs")
    assert direct_target("ll-prio#2") == ("ll", "priority")
    assert direct_target("spf") is None and direct_target("magnus@continuous") is None
    assert labels(["rr-fcfs", "spf"], 2) == [("rr-fcfs", "rr-fcfs"), ("rr-fcfs#2", "rr-fcfs"), ("spf", "spf"),
                                             ("spf#2", "spf")]


def _result(sent, first, done, tokens, itl_sum) -> StreamResult:
    a = [np.asarray(x, dtype=float) for x in (sent, first, done)]
    return StreamResult(*a, np.asarray(tokens, dtype=np.int64), np.asarray(itl_sum, dtype=float),
                        ~np.isnan(a[2]), float(np.nanmax(a[2])), {})


@dataclass
class _Arrivals:
    arrival: np.ndarray


def test_speedup_scales_arrivals_down_and_measured_times_back_up():
    wl = to_wall(_Arrivals(np.array([0.0, 1.0, 3.0])), 0.25)
    assert list(wl.arrival) == [0.0, 4.0, 12.0]   # engines 4x slower than wall time: arrivals 4x apart
    res = to_model(_result([0, 4], [1, 6], [2, 10], [3, 5], [0.5, 2.0]), 0.25)
    assert list(res.sent) == [0, 1] and list(res.first) == [0.25, 1.5] and list(res.done) == [0.5, 2.5]
    assert list(res.itl_sum) == [0.125, 0.5] and res.wall_s == 2.5


def test_summary_percentiles_goodput_and_lost_requests():
    # four answered, one lost; SLOs make request 1 miss its e2e and request 2 miss TTFT (> 1 s)
    res = _result([0, 0, 0, 0, 1], [0.5, 0.5, 2.0, 0.5, math.nan], [1, 3, 4, 2, math.nan], [5, 5, 5, 5, 0],
                  [0.4, 2.0, 1.6, 1.2, 0])
    m = summary(SimpleNamespace(slo_s=np.array([2.0, 2.0, 10.0, 5.0, 5.0])), res)
    assert m["done"] == 4 and m["lost"] == 1
    assert m["throughput_rps"] == pytest.approx(4 / 4) and m["goodput_rps"] == pytest.approx(2 / 4)
    assert m["mean_latency_s"] == pytest.approx(2.5) and m["p50_latency_s"] == pytest.approx(2.5)
    assert m["p99_latency_s"] == pytest.approx(np.percentile([1, 3, 4, 2], 99))
    assert m["p90_ttft_s"] == pytest.approx(np.percentile([0.5, 0.5, 2.0, 0.5], 90))
    assert m["p50_itl_s"] == pytest.approx(np.median([0.1, 0.5, 0.4, 0.3]))


def test_saturated_rate_leaves_out_the_ramp_and_the_drain():
    # 100 requests done 0.1 s apart (10/s), then a drain: 5 long ones trickle in 2 s apart
    done = [1 + 0.1 * i for i in range(100)] + [12 + 2 * i for i in range(5)]
    n = len(done)
    res = _result([0] * n, [0.5] * n, done, [5] * n, [1.0] * n)
    assert res.wall_s == 20 and n / res.wall_s == pytest.approx(5.25)   # done / span: half the rate
    assert saturated_rps(res) == pytest.approx(10.0, rel=0.02)
    assert math.isnan(saturated_rps(_result([0] * 3, [1] * 3, [1, 2, 3], [1] * 3, [0] * 3)))  # too few to say


METRICS = """# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 3.0
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 200.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 50.0
vllm:request_success_total{engine="0",model_name="m",finished_reason="length"} 7.0
vllm:time_to_first_token_seconds_bucket{engine="0",model_name="m",le="+Inf"} 7
engine_sim_steps_total{engine="0",model_name="m"} 400.0
engine_sim_late_steps_total{engine="0",model_name="m"} 2.0
"""


def test_engine_counters_sum_over_the_fleet_with_the_hit_rate():
    one = parse_metrics(METRICS)
    assert one["vllm:num_preemptions_total"] == 3.0 and one["vllm:request_success_total"] == 7.0
    tot = engine_totals([one, parse_metrics(METRICS.replace("50.0", "150.0"))])
    assert tot["preemptions"] == 6 and tot["finished"] == 14
    assert tot["prefix_hit_rate"] == pytest.approx(200 / 400)
    assert len(tot["per_engine"]) == 2 and engine_totals([{}])["prefix_hit_rate"] == 0.0
    assert tot["late_step_share"] == pytest.approx(4 / 800) and engine_totals([{}])["late_step_share"] == 0.0


def test_ratios_targets_and_spread():
    runs = {"rr-fcfs": {"mean_latency_s": 2.0, "p50_latency_s": 1.0, "p99_latency_s": 10.0, "goodput_rps": 4.0,
                        "throughput_rps": 10.0},
            "spf": {"mean_latency_s": 1.2, "p50_latency_s": 0.4, "p99_latency_s": 13.0, "goodput_rps": 6.0,
                    "throughput_rps": 9.8}}
    assert ratios_to(runs, "rr-fcfs", ["mean_latency_s"])["spf"]["mean_latency_s"] == pytest.approx(0.6)
    checks = {c["metric"]: c["met"] for c in check_targets(runs, "spf", "magnus")}
    assert checks == {"mean_latency_s": True, "p50_latency_s": True, "p99_latency_s": False, "goodput_rps": True,
                      "throughput_rps": True}
    assert spread([1.0, 1.1, 0.9]) == pytest.approx(0.2) and spread([]) == 0.0


def test_engine_spec_is_the_command_line():
    args = EngineSpec(num_gpu_blocks=48, max_model_len=752, speedup=0.25).args(8100, "priority", ["--die-after", "2"])
    assert args[1:4] == ["-m", "bench.engine_sim.cli", "serve"]
    for flag, value in (("--port", "8100"), ("--num-gpu-blocks", "48"), ("--max-model-len", "752"),
                        ("--speedup", "0.25"), ("--scheduling-policy", "priority"), ("--die-after", "2")):
        assert args[args.index(flag) + 1] == value
