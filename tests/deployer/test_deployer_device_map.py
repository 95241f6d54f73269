"""device_map construction from the model's own module names, and loading with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import deployer
from deployer.cluster import Cluster, Device
from deployer.device_map import (
    balanced_map,
    evaluate_map,
    even_split_map,
    plan_to_device_map,
    resolve,
    usable_memory,
    validate_device_map,
)
from deployer.helr_cost import Problem
from deployer.model_shape import load_model_shape, shape_from_module
from deployer.planner import build_problem, plan_deployment


def tensor_names(model: nn.Module) -> list[str]:
    return [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers()]


def small_cluster(n: int, mem: int, perf: list[float] | None = None) -> Cluster:
    perf = perf or [1.0] * n
    lat = np.full((n, n), 0.05)
    np.fill_diagonal(lat, 0.0)
    return Cluster(devices=[Device(id=i, memory_bytes=mem, perf=perf[i]) for i in range(n)], latency_ms=lat)


# --- ChatGLM-style naming (transformer.encoder.layers.N) built locally: no remote code offline ---


class GLMBlock(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(h)
        self.self_attention = nn.Linear(h, 3 * h)
        self.mlp = nn.Linear(h, 4 * h)


class Encoder(nn.Module):
    def __init__(self, h: int, n: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(GLMBlock(h) for _ in range(n))
        self.final_layernorm = nn.LayerNorm(h)


class Embedding(nn.Module):
    def __init__(self, v: int, h: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(v, h)


class Rotary(nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.register_buffer("inv_freq", torch.ones(h // 2))


class ChatGLMModel(nn.Module):
    def __init__(self, v: int = 100, h: int = 16, n: int = 5) -> None:
        super().__init__()
        self.embedding = Embedding(v, h)
        self.rotary_pos_emb = Rotary(h)
        self.encoder = Encoder(h, n)
        self.output_layer = nn.Linear(h, v, bias=False)


class ChatGLMForConditionalGeneration(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.transformer = ChatGLMModel()


def test_chatglm_style_naming():
    model = ChatGLMForConditionalGeneration()
    shape = shape_from_module(model, dtype="float16", num_layers=5)
    assert shape.layer_prefix == "transformer.encoder.layers"
    assert shape.layer_names == [f"transformer.encoder.layers.{i}" for i in range(5)]
    roles = {u.name: u.role for u in shape.units}
    assert roles["transformer.embedding"] == "pre"
    assert roles["transformer.encoder.final_layernorm"] == "post"
    assert roles["transformer.output_layer"] == "post"
    assert "GLMBlock" in shape.no_split_module_classes
    dmap = plan_to_device_map(shape, [2, 0, 1], [2, 2, 1])
    assert validate_device_map(tensor_names(model), dmap) == []
    assert dmap["transformer.embedding"] == 2 and dmap["transformer.rotary_pos_emb"] == 2
    assert dmap["transformer.output_layer"] == 1 and dmap["transformer.encoder.final_layernorm"] == 1
    assert [dmap[f"transformer.encoder.layers.{i}"] for i in range(5)] == [2, 2, 0, 0, 1]
    head = 100 * 16 * 2
    assert shape.last_read_bytes == head + 2 * 16 * 2  # head matmul + final norm
    # and accelerate's balanced map works on it too
    problem = build_problem(small_cluster(3, 10**6), shape, kv_reserve_bytes=0)
    bal = balanced_map(shape, usable_memory(problem))
    assert validate_device_map(tensor_names(model), bal) == []


def test_llama_map_covers_every_module_once_and_loads(tiny_llama):
    from transformers import AutoModelForCausalLM

    shape = load_model_shape(tiny_llama)
    assert shape.layer_prefix == "model.layers" and shape.num_layers == 3
    cluster = small_cluster(3, shape.total_bytes // 2 + 1, perf=[1.0, 0.5, 0.8])
    dep = plan_deployment(shape, cluster, "lr", kv_reserve_bytes=0)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama)
    names = tensor_names(model)
    for dmap in (dep.device_map, dep.baselines["even"][0], dep.baselines["balanced"][0]):
        assert dmap, "empty map"
        assert validate_device_map(names, dmap) == []
    dmap = dep.device_map
    first, last = dep.devices[0], dep.devices[-1]
    assert dmap["model.embed_tokens"] == first and dmap["model.rotary_emb"] == first
    assert dmap["lm_head"] == last and dmap["model.norm"] == last
    # loading with the planned map's keys (values -> "cpu": no GPU here) reproduces the model
    cpu_map = {k: "cpu" for k in dmap}
    loaded = AutoModelForCausalLM.from_pretrained(tiny_llama, device_map=cpu_map)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, model(ids).logits, atol=1e-5)


def test_tied_head_goes_with_embedding(tiny_llama_tied):
    shape = load_model_shape(tiny_llama_tied)
    head = next(u for u in shape.units if u.name == "lm_head")
    assert head.tied_to_pre and head.bytes == 0 and head.read_bytes > 0
    dmap = plan_to_device_map(shape, [1, 0], [2, 1])
    assert dmap["lm_head"] == dmap["model.embed_tokens"] == 1
    problem = build_problem(small_cluster(2, 10**6), shape, kv_reserve_bytes=0)
    assert problem.return_hop
    ev = evaluate_map(shape, problem, dmap)
    assert ev.order == [1, 0] and ev.hop_ms == pytest.approx(0.1)  # there and back


def test_even_map_and_pricing(shape_6b):
    cluster = small_cluster(4, 8 * 1024**3, perf=[1.0, 0.5, 1.0, 0.5])
    problem = build_problem(cluster, shape_6b, kv_reserve_bytes=0)
    even = even_split_map(shape_6b, [0, 1, 2, 3])
    ev = evaluate_map(shape_6b, problem, even)
    assert ev.layers == {0: 7, 1: 7, 2: 7, 3: 7} and ev.order == [0, 1, 2, 3]
    assert ev.hop_ms == pytest.approx(3 * problem.hop[0, 1])
    assert ev.fits


def test_resolve_prefixes():
    dmap = {"model.layers.1": 0, "model.layers.10": 1, "": 3}
    assert resolve(dmap, "model.layers.1.mlp.weight") == 0
    assert resolve(dmap, "model.layers.10.mlp.weight") == 1
    assert resolve(dmap, "lm_head.weight") == 3
    assert validate_device_map(["a.weight"], {"a": 0, "a.weight": 1})


def test_plan_device_map_entry_point(tiny_llama, examples, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    topo = str(examples / "thesis_4gpu.yaml")
    assert deployer.plan_device_map(str(tiny_llama), "helr", topo) is None  # no CUDA -> CPU
    dmap = deployer.plan_device_map(str(tiny_llama), "helr", topo, None, 0, require_cuda=False)
    assert dmap is not None and set(dmap.values()) == {0}  # tiny model: the fastest GPU alone
    assert dmap["model.layers.2"] == 0
    with pytest.raises(deployer.DeploymentInfeasible, match="needs"):
        deployer.plan_device_map(str(tiny_llama), "he", topo, None, int(23.5 * 1024**3), require_cuda=False)


def test_problem_validation():
    with pytest.raises(ValueError):
        Problem(mem=[1, 2], perf=[1.0], hop=np.zeros((2, 2)), num_layers=1, layer_bytes=1)
    with pytest.raises(ValueError):
        Problem(mem=[1], perf=[0.0], hop=np.zeros((1, 1)), num_layers=1, layer_bytes=1)
