"""Step-time models: the fitted form's loader and least-squares helper, the roofline's presets and
default KV pool."""

from __future__ import annotations

import json
import random

import pytest

from bench.engine_sim.fit import fit_step_time
from bench.engine_sim.roofline_steps import default_num_blocks, roofline_step_time
from bench.engine_sim.step_time import FittedStepTime, StepShape, load_fit
from bench.roofline import MODELS


def _shapes(n: int, seed: int = 0) -> list[StepShape]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = rng.randint(0, 128)
        ctx = rows * rng.randint(50, 2000)
        pre = rng.choice([0, 0, rng.randint(16, 4096)])
        out.append(StepShape(prefill_tokens=pre, prefill_context=pre, decode_rows=rows, decode_context=ctx))
    return out


def test_fit_recovers_the_coefficients_that_made_the_samples() -> None:
    truth = FittedStepTime(a=0.004, b=3e-5, c=2e-5, d=4e-8)
    shapes = _shapes(60)
    fit = fit_step_time((s, truth.seconds(s)) for s in shapes)
    for got, want in zip((fit.a, fit.b, fit.c, fit.d), (truth.a, truth.b, truth.c, truth.d), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_reproduces_the_roofline_on_decode_steps() -> None:
    """Decode steps are memory-bound on the roofline (weights + KV read): linear in the context."""
    roof = roofline_step_time("h100-80gb", "llama-3-8b")
    shapes = [StepShape(decode_rows=r, decode_context=r * c) for r in (1, 8, 32, 64) for c in (100, 500, 2000)]
    fit = fit_step_time((s, roof.seconds(s)) for s in shapes)
    for s in shapes:
        assert fit.seconds(s) == pytest.approx(roof.seconds(s), rel=0.02)


def test_fit_needs_four_samples() -> None:
    with pytest.raises(ValueError):
        fit_step_time([(StepShape(decode_rows=1), 0.01)] * 3)


def test_load_fit_round_trips_and_refuses_other_forms(tmp_path) -> None:
    f = tmp_path / "fit.json"
    want = FittedStepTime(0.003, 1e-5, 2e-5, 3e-8)
    f.write_text(json.dumps(want.to_json()))
    assert load_fit(f) == want
    f.write_text(json.dumps({"form": "quadratic", "a": 1}))
    with pytest.raises(ValueError):
        load_fit(f)


def test_llama3_preset_and_default_pool() -> None:
    m = MODELS["llama-3-8b"]
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) == (32, 4096, 32, 8, 128)
    assert m.delta_bytes == 2 * 32 * 8 * 128 * 2          # 128 KiB of KV per token in bf16
    one = default_num_blocks("h100-80gb", "llama-3-8b", 1, 16)
    assert 25_000 < one < 32_000                          # ~60 GB of KV on an H100-80GB
    assert default_num_blocks("h100-80gb", "llama-3-8b", 2, 16) > 2 * one   # the weights split too


def test_a_bigger_step_never_takes_less_time() -> None:
    roof = roofline_step_time("h100-80gb", "llama-3-8b")
    small = StepShape(decode_rows=4, decode_context=4000)
    assert roof.seconds(StepShape(decode_rows=8, decode_context=8000)) >= roof.seconds(small)
    assert roof.seconds(StepShape(prefill_tokens=2048, prefill_context=2048)) > roof.seconds(small)
