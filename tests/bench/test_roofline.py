"""Roofline batch time and presets; the fitted model from profile samples."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bench.roofline import GPUS, MODELS, fitted_time_model, instance
from cohort.settings import DEFAULT_MODEL
from cohort.tokenizer import load_tokenizer
from cohort.units import dtype_bytes


def test_default_is_magnus_testbed():
    inst = instance()
    assert inst.gpu.name == "V100-32GB" and inst.model.name == "ChatGLM-6B"
    assert inst.model.delta_bytes == 2 * 28 * 32 * 128 * 2
    # Θ = 32 GiB − 12.3 GB of fp16 weights − 10 % reserve ≈ 18.6 GB ≈ 40k tokens
    assert 35_000 < inst.theta_bytes // inst.model.delta_bytes < 45_000


@pytest.mark.parametrize("gpu", sorted(GPUS))
@pytest.mark.parametrize("model", ["chatglm-6b", "llama-7b"])
def test_scalar_and_vector_paths_agree_and_grow(gpu, model):
    tm = instance(gpu, model).time_model()
    shapes = [(b, L, G) for b in (1, 8, 64, 400) for L in (10, 300) for G in (0, 1, 50, 900)]
    many = tm.estimate_many(shapes)
    for s, t in zip(shapes, many, strict=True):
        assert tm.estimate(*s) == pytest.approx(t, rel=1e-12)
    # more tokens to generate, longer input, bigger batch: never faster
    assert tm.estimate(8, 100, 200) > tm.estimate(8, 100, 100)
    assert tm.estimate(8, 300, 100) > tm.estimate(8, 100, 100)
    assert tm.estimate(64, 100, 100) > tm.estimate(8, 100, 100)
    # but batching amortises the weight reads: 64 requests together beat 8 batches of 8
    assert tm.estimate(64, 100, 100) < 8 * tm.estimate(8, 100, 100)


def test_decode_turns_compute_bound_for_huge_batches():
    tm = instance().time_model()
    # per-step cost: nearly flat in β while memory-bound, linear once compute-bound
    small = tm.estimate(16, 10, 100) - tm.estimate(8, 10, 100)
    big = tm.estimate(2000, 10, 100) - tm.estimate(1992, 10, 100)
    assert big > small


def test_faster_gpu_is_faster():
    s = (32, 200, 200)
    t = {g: instance(g).time_model().estimate(*s) for g in GPUS}
    assert t["h100-80gb"] < t["a100-80gb"] < t["v100-32gb"]
    assert instance("a100-80gb").theta_bytes > instance().theta_bytes
    assert "tiny" in MODELS


def test_fitted_model_from_profile_samples(tmp_path):
    truth = instance().time_model()
    shapes = [(b, L, G) for b in (1, 4, 16) for L in (16, 64) for G in (8, 32, 64)]
    samples = [{"size": b, "input_len": L, "gen_len": G, "seconds": truth.estimate(b, L, G)} for b, L, G in shapes]
    p = tmp_path / "samples.json"
    p.write_text(json.dumps(samples))
    fit = fitted_time_model(p)
    got = np.asarray(fit.estimate_many(shapes))
    want = truth.estimate_many(shapes)
    assert np.median(np.abs(got - want) / want) < 0.1
    p.write_text(json.dumps({"samples": samples[:2]}))
    with pytest.raises(ValueError):
        fitted_time_model(p)


@pytest.mark.model  # builds the built-in Llama (on the meta device): transformers' model classes, seconds to import
def test_tiny_preset_is_the_built_in_model():
    """The roofline's "tiny" is the model a CPU worker serves by default: same shape, same
    parameter count, the dtype the worker picks on a CPU."""
    torch = pytest.importorskip("torch")  # torch and transformers: this test only
    model = pytest.importorskip("workers.model")
    from transformers import LlamaForCausalLM  # the model classes: this test only

    tok = load_tokenizer(DEFAULT_MODEL)
    cfg = model.tiny_llama_config(len(tok), tok.pad_token_id, tok.eos_token_id, tok.cls_token_id)
    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    m = MODELS["tiny"]
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim) == (
        cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    assert m.params == params
    assert m.dtype_bytes == dtype_bytes(str(model.resolve_dtype("auto", torch.device("cpu"))))
