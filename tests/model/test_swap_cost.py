"""The live swap-or-recompute decision reads the fitted recompute cost (issue 19 item 3): the
engine picks up a cost file profiled for its model and device, the per-victim decision prices a
recompute beside the rows still running, and the prefill timer samples the executor's packed
prefill. Greedy tokens are the same whichever way a victim comes back."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batcher.preemption import SwapLink
from cohort.settings import Settings
from cohort.types import Batch, ProfiledRequest
from predictor.recompute_cost import PrefillSamples, model_search, save_cost_file
from tests.model.rendered import step_rendered
from workers.continuous import ContinuousRun, SwapPlan
from workers.engine import LLMEngine
from workers.prefill_timer import PrefillTimer, profile_prefill_shapes, repeat_spread
from workers.swap_pool import HostSwapPool

PROMPTS = ["Translate to French: good morning", "Hi", "Summarise: the cat sat on the mat"]


def _run(engine: LLMEngine, cost) -> tuple[ContinuousRun, dict[str, str]]:
    """Three rows predicted to stop after 1 token in 10 pages of 8: they outgrow the pool."""
    plan = SwapPlan("adaptive", HostSwapPool(10**6, pin=False), SwapLink(1e9, 1e9), engine.delta_bytes,
                    prefill_s_per_token=1.0, recompute_cost=cost)
    run = ContinuousRun(engine.model, engine.tokenizer, engine.device, torch.float32, num_pages=10, page_size=8,
                        token_budget=16, swap=plan)
    reqs = [ProfiledRequest(id=f"r{i}", prompt=p, input_tokens=len(p.split()), arrival=0.0, predicted_tokens=1,
                            max_tokens=24) for i, p in enumerate(PROMPTS)]
    run.submit(Batch(id="A", requests=reqs, created=0.0), [engine.prompt_ids(r.prompt) for r in reqs])
    texts, stages = {}, {}
    for _ in range(2000):
        if run.idle:
            break
        for o in step_rendered(run, stages).values():
            texts.update({f.request.id: f.text for f in o.finished})
        run.finished_groups()
    return run, texts


def test_the_decision_prices_a_recompute_with_the_fitted_cost_beside_the_running_rows(engine):
    calls: list[tuple[int, int]] = []

    def dear(tokens: int, running: int) -> float:
        calls.append((tokens, running))
        return 1.0  # a second: any swap over a 1 GB/s link is cheaper

    swapped_run, swapped = _run(engine, dear)
    assert swapped_run.evictions > 0 and swapped_run.swaps == swapped_run.evictions
    assert len(calls) == swapped_run.evictions
    assert all(tokens > 0 and 0 <= running < len(PROMPTS) for tokens, running in calls)  # the victim is not counted
    recomputed_run, recomputed = _run(engine, lambda tokens, running: 0.0)  # free: never swap
    assert recomputed_run.evictions > 0 and recomputed_run.swaps == 0
    assert swapped == recomputed and len(swapped) == len(PROMPTS)  # greedy tokens either way


def test_the_engine_uses_a_cost_file_of_its_model_and_device_and_falls_back_otherwise(engine, tmp_path):
    rng = np.random.default_rng(0)
    shapes = [(L, b, 4, 128) for b in (1, 2, 4, 8) for L in (16, 32, 64, 128)]
    x = np.array(shapes, dtype=float)
    samples = PrefillSamples(x, 1e-3 + 1e-5 * x[:, 0] * x[:, 1] * (1 + rng.normal(0, 1e-3, len(x))))
    res = model_search(samples, models=("linear", "random_forest"), degrees=(1, 2))
    mine = save_cost_file(tmp_path / "mine.json", samples, res, engine.settings.model, engine.device.type)
    other = save_cost_file(tmp_path / "other.json", samples, res, "some/other-model", engine.device.type)
    base = {"profile_on_start": False, "preemption": "adaptive", "swap_bytes": 1 << 20}
    try:
        engine.settings = Settings(**base, recompute_cost_path=mine)
        plan = engine.swap_plan()
        assert plan.recompute_cost is not None
        assert plan.recompute_seconds(64, 3) == pytest.approx(engine.recompute_cost().recompute_seconds(64, 3))
        del engine._fitted_cost
        engine.settings = Settings(**base, recompute_cost_path=other)
        plan = engine.swap_plan()
        assert plan.recompute_cost is None and plan.recompute_seconds(64, 3) == 64 * plan.prefill_s_per_token
    finally:
        engine.__dict__.pop("_fitted_cost", None)
        engine.settings = Settings(profile_on_start=False)


@pytest.mark.slow  # times the real model's prefill, repeated per shape: seconds
def test_the_prefill_timer_samples_the_packed_prefill_with_its_spread(engine):
    timer = PrefillTimer(engine.model, engine.dtype, engine.device, max_tokens=512, page_size=16)
    small, large = profile_prefill_shapes(timer, [(1, 16), (4, 128)], repeats=2, rounds=2, show_progress=False)
    assert len(small["repeats"]) == 4 and small["seconds"] == min(small["repeats"]) > 0
    assert large["seconds"] > small["seconds"]  # 32× the tokens
    assert small["spread_pct"] == pytest.approx(repeat_spread(small["repeats"]), abs=1e-3) and small["spread_pct"] >= 0
    assert timer.book.free_tokens == timer.book.capacity_tokens  # every page given back
    with pytest.raises(ValueError):
        timer.time_shape(64, 512, 1)
