"""The vLLM 0.2.5 engine model (AdaptiveLLM's base, issue 19): whole padded prompt steps under
max_num_batched_tokens and max_paddings, the page watermark, FCFS victims by arrival, swap-only
fallbacks counted; and the simulator's online quantile (issue 20)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench.continuous import ContinuousEngine, EngineLimits, SimInstance, SimRow, StepStats
from bench.continuous_sched import FCFSScheduler
from bench.online_quantile import OnlineQuantile
from tests.bench.helpers import mk
from tests.bench.test_continuous import INST, TM, run, trace


def test_vllm025_defaults_follow_its_config():
    lim = EngineLimits.vllm_025(gpu_pages=128)
    assert (lim.max_batched_tokens, lim.max_paddings, lim.watermark_pages, lim.chunked_prefill) == (4096, 256, 1, False)


def test_prompt_step_takes_whole_prompts_under_the_padded_budget():
    lim = EngineLimits(max_batched_tokens=1000, chunked_prefill=False, max_paddings=10_000)
    s = FCFSScheduler(lim)
    for i, L in enumerate([300, 100, 200, 50]):
        s.add(mk(i, L, 5), 0.0)
    got = s.admit(SimInstance(pages=1000, limits=lim), 0.0, lim.max_batched_tokens)
    assert [r.input_tokens for r in got] == [300, 100, 200]      # 4 · 300 = 1,200 padded tokens > 1,000
    s = FCFSScheduler(replace(lim, max_paddings=250))
    for i, L in enumerate([300, 100, 200]):
        s.add(mk(i, L, 5), 0.0)
    got = s.admit(SimInstance(pages=1000, limits=lim), 0.0, lim.max_batched_tokens)
    assert [r.input_tokens for r in got] == [300, 100]            # 200 pads with the second, 300 with the third
    s = FCFSScheduler(replace(lim, watermark_pages=2))
    s.add(mk(0, 16 * 5, 5), 0.0)
    s.add(mk(1, 16 * 4, 5), 0.0)
    got = s.admit(SimInstance(pages=10, limits=lim), 0.0, lim.max_batched_tokens)
    assert len(got) == 1                                          # 10 − 5 − 4 = 1 page left < the 2-page watermark


def test_a_prompt_step_is_costed_padded_and_runs_alone():
    lim = EngineLimits(chunked_prefill=False, max_paddings=1000)
    sched = FCFSScheduler(lim)
    firsts: list[float] = []
    eng = ContinuousEngine(TM, sched, lim, StepStats(), lambda j, at, ok: None, lambda j, at: firsts.append(at), [0])
    inst = SimInstance(pages=256, limits=lim)
    inst.rows.append(SimRow(9, mk(9, 10, 50), 0))                 # a decoding row: it waits for the prompt step
    inst.rows[0].filled = inst.rows[0].kv = 10
    for i, L in enumerate([400, 10]):
        sched.add(mk(i, L, 3), 0.0)
    end = eng.step(inst, 0.0, {"q0": 0, "q1": 1})
    padded = TM.step_seconds(800.0, 2 * 400 * 400 / 2.0, 0.0, 0.0, 0.0)
    assert padded > TM.step_seconds(410.0, 400 * 200 + 10 * 5, 0.0, 0.0, 0.0)
    assert end == pytest.approx(padded) and firsts == [end, end]
    assert inst.rows[0].kv == 10                                  # the decoding row did not advance


def test_fcfs_victim_is_the_newest_arrival():
    lim = EngineLimits()
    rows = []
    for j, (arrival, order) in enumerate([(0.0, 3), (2.0, 1), (1.0, 2)]):
        row = SimRow(j, replace(mk(j, 10, 50), arrival=arrival), order)
        rows.append(row)
    assert FCFSScheduler(lim).victim(rows, 0, 5.0) == 1           # arrived last, though admitted first
    assert FCFSScheduler(lim).victim(rows, 2, 5.0) == 2


def test_swap_only_counts_victims_recomputed_for_a_full_host_pool():
    reqs = trace(200, rate=500.0, noise=0.0)
    lim = EngineLimits.vllm_025(gpu_pages=64)
    r = run(reqs, "cb-fcfs", tokens=64 * 16, limits=lim, preemption="swap", link=INST.swap_link(), host_pages=4)
    m = r.metrics
    assert m["completed"] == len(reqs)
    assert r.extra["swap_fallbacks"] > 0 and m["recomputes"] >= r.extra["swap_fallbacks"]
    a = run(reqs, "cb-fcfs", tokens=64 * 16, limits=lim, preemption="adaptive", link=INST.swap_link(), host_pages=4)
    assert a.extra["swap_fallbacks"] == 0


def test_online_quantile_widens_after_under_predictions():
    oq = OnlineQuantile(None)
    first = oq.plan(replace(mk(0, 10, 100, pred=50), max_tokens=1000))
    assert first.predicted_upper == 1000                          # nothing calibrated: the worst case
    for i in range(1, 200):                                       # every answer is 2× its prediction
        req = replace(mk(i, 10, 100, pred=50), max_tokens=1000)
        oq.completed(oq.plan(req))
    later = oq.plan(replace(mk(999, 10, 100, pred=50), max_tokens=1000))
    assert 100 <= later.predicted_upper < 1000                    # learnt: covers the 2× answers, not the cap


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_simulate_with_the_online_quantile_answers_everything():
    reqs = [replace(r, predicted_upper=r.predicted_tokens, max_tokens=512) for r in trace(300, rate=200.0, noise=0.5)]
    r = run(reqs, "spf", tokens=2048, online=OnlineQuantile(None))
    assert r.metrics["completed"] == len(reqs) and r.extra["quantile"] == "online"
    s = run(reqs, "spf", tokens=2048)
    assert s.extra["quantile"] == "static"
