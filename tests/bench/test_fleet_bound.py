"""The solo bound (``bench.fleet_bound``): a request alone on the simulated engine takes exactly its
solo time, and no request of a shared engine finishes sooner than its solo time. Deterministic: the
engine runs on a clock the test moves by hand."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from bench.engine_sim.engine import SteppedEngine
from bench.engine_sim.faults import Faults
from bench.engine_sim.step_time import FittedStepTime
from bench.fleet_bench import SOLO, check_targets
from bench.fleet_bound import alone_on_engine, solo_result
from tests.bench.engine_sim.helpers import make_req, make_sched
from tests.bench.engine_sim.test_front_end import HandClock

# 5 ms a step, 0.2 ms a decode row, 2 µs a context token; prompt tokens cost only their context
# (the H100 roofline's regime at these sizes: a step's weights read dominates)
STEP = FittedStepTime(a=0.005, b=0.0, c=0.0002, d=0.000002)


def _serve(prompts: list[int], gens: list[int]) -> list[tuple[float, float]]:
    """(TTFT, e2e) of each request, all submitted at once to one simulated engine."""
    async def go() -> list[tuple[float, float]]:
        clock = HandClock()
        eng = SteppedEngine(make_sched(num_blocks=400, max_model_len=4096), STEP, clock, Faults())  # type: ignore[arg-type]
        reqs = [make_req(p, max_tokens=g, arrival=0.0) for p, g in zip(prompts, gens, strict=True)]
        for r in reqs:
            eng.submit(r)
        await asyncio.sleep(0)
        while any(r.finish_reason is None for r in reqs):
            await clock.advance()
        await eng.stop()
        return [(r.first_token_at, r.last_token_at) for r in reqs]
    return asyncio.run(go())


def test_a_request_alone_takes_its_solo_time() -> None:
    (ttft, e2e), = _serve([100], [12])
    assert (ttft, e2e) == pytest.approx(alone_on_engine(STEP, 100, 12))


def test_no_request_of_a_shared_engine_beats_its_solo_time() -> None:
    prompts, gens = [100, 40, 300, 64, 16], [12, 30, 5, 20, 1]
    for (ttft, e2e), p, g in zip(_serve(prompts, gens), prompts, gens, strict=True):
        solo_ttft, solo_e2e = alone_on_engine(STEP, p, g)
        assert ttft >= solo_ttft - 1e-12 and e2e >= solo_e2e - 1e-12


# prompt tokens cost 0.1 ms each here, so what the cache holds shows in the first step
STEP_PREFILL = FittedStepTime(a=0.005, b=0.0001, c=0.0002, d=0.000002)


def _serve_after(first: list[int], second: list[int], gen: int) -> float:
    """The TTFT of ``second``, submitted alone once ``first`` has run to its end on the same engine
    (whose prefix cache then holds ``first``'s full pages)."""
    async def go() -> float:
        clock = HandClock()
        eng = SteppedEngine(make_sched(num_blocks=400, max_model_len=4096), STEP_PREFILL, clock, Faults())  # type: ignore[arg-type]
        a = make_req(first, max_tokens=2, arrival=0.0)
        eng.submit(a)
        await asyncio.sleep(0)
        while a.finish_reason is None:
            await clock.advance()
        t0 = clock.now()
        b = make_req(second, max_tokens=gen, arrival=t0)
        eng.submit(b)
        await asyncio.sleep(0)
        while b.finish_reason is None:
            await clock.advance()
        await eng.stop()
        return b.first_token_at - t0
    return asyncio.run(go())


def test_a_prompt_sharing_an_earlier_ones_prefix_takes_no_less_than_its_bound() -> None:
    """70 tokens shared with an earlier prompt: the engine caches 4 full pages of 16 (64 tokens) and
    computes the other 56; the bound, caching all 70, is lower, and exact at 64."""
    first = list(range(1000, 1100))
    second = first[:70] + list(range(5000, 5050))
    ttft = _serve_after(first, second, 3)
    assert ttft == pytest.approx(alone_on_engine(STEP_PREFILL, 120, 3, cached=64)[0])
    assert ttft > alone_on_engine(STEP_PREFILL, 120, 3, cached=70)[0]
    assert alone_on_engine(STEP_PREFILL, 120, 3, cached=70)[0] > alone_on_engine(STEP_PREFILL, 120, 3)[0]


class _Workload:
    """What ``solo_result`` reads of a workload."""

    class config:  # noqa: N801
        max_tokens = 8

    arrival = np.array([0.0, 1.0, 2.5])
    input_tokens = np.array([10, 20, 30])
    true_tokens = np.array([4, 0, 50])   # 0: still one token; 50: capped at max_tokens


def test_the_solo_result_starts_each_request_at_its_arrival() -> None:
    res = solo_result(_Workload(), STEP)  # type: ignore[arg-type]
    assert list(res.tokens) == [4, 1, 8]
    for i, (p, g) in enumerate([(10, 4), (20, 1), (30, 8)]):
        ttft, e2e = alone_on_engine(STEP, p, g)
        assert res.first[i] == pytest.approx(_Workload.arrival[i] + ttft)
        assert res.done[i] == pytest.approx(_Workload.arrival[i] + e2e)
    assert res.ok.all() and res.wall_s == pytest.approx(res.done[2])


def test_a_workload_that_knows_its_shared_prefixes_caches_only_those() -> None:
    class Shared(_Workload):
        shared_tokens = np.array([0, 15, 40])  # 40 > the prompt's 30: all but its last token
    res = solo_result(Shared(), STEP_PREFILL)  # type: ignore[arg-type]
    for i, (p, g, c) in enumerate([(10, 4, 0), (20, 1, 15), (30, 8, 29)]):
        assert res.first[i] == pytest.approx(Shared.arrival[i] + alone_on_engine(STEP_PREFILL, p, g, c)[0])
    assert res.first[0] > solo_result(_Workload(), STEP_PREFILL).first[0]  # type: ignore[arg-type]


def test_a_target_below_the_solo_bound_is_reported_unreachable() -> None:
    runs = {"rr-fcfs": {"mean_latency_s": 1.0, "p50_latency_s": 1.0, "p99_latency_s": 1.0, "goodput_rps": 1.0,
                        "throughput_rps": 1.0},
            SOLO: {"mean_latency_s": 0.6, "p50_latency_s": 0.6, "p99_latency_s": 0.3, "goodput_rps": 1.1,
                   "throughput_rps": 1.0},
            "spf": {"mean_latency_s": 0.65, "p50_latency_s": 0.62, "p99_latency_s": 0.9, "goodput_rps": 1.05,
                    "throughput_rps": 1.0}}
    by = {c["metric"]: c for c in check_targets(runs, "spf", "magnus")}
    assert by["mean_latency_s"]["met"] and by["mean_latency_s"]["reachable"]
    assert not by["p50_latency_s"]["met"] and not by["p50_latency_s"]["reachable"]
    assert by["p50_latency_s"]["best_possible"] == pytest.approx(0.6)
    assert not by["goodput_rps"]["reachable"] and by["throughput_rps"]["reachable"]


def test_the_bound_says_nothing_of_the_prefix_hit_rate() -> None:
    """The chat trace's hit-rate target gets no best possible: the bound's engines model no cache."""
    runs = {"rr-fcfs": {"prefix_hit_rate": 0.5, "mean_ttft_s": 0.02}, SOLO: {"prefix_hit_rate": 0.0, "mean_ttft_s": 0.008},
            "spf": {"prefix_hit_rate": 0.75, "mean_ttft_s": 0.021}}
    by = {c["metric"]: c for c in check_targets(runs, "spf", "chat")}
    assert "best_possible" not in by["prefix_hit_rate"]
    assert by["mean_ttft_s"]["best_possible"] == pytest.approx(0.4) and by["mean_ttft_s"]["reachable"]
