"""Batch-time models for the simulator: an analytic roofline of static-batch generation, with
GPU and model presets, and the fitted model from ``cohort worker profile`` samples.

Why a roofline: static batching on HF ``generate`` is (1) one prefill over β·L(B) padded tokens,
which is compute-bound, then (2) G(B) decode steps, each of which reads every weight once and
the whole KV cache of the batch, β·(L(B)+g)·Δ bytes at step g; below β ≈ FLOP/s ÷ bandwidth a
step is bound by those reads, above it by 2·params·β FLOPs. That is exactly why bigger batches
of similar lengths win (Magnus) and why padding costs (WMA): the KV part of every step grows
with β·L(B). A per-step framework overhead (Python, kernel launches) and a per-batch overhead
make the absolute numbers look like HF eager rather than like an ideal kernel.

Θ (KV memory) = device memory − weights − an activation reserve, Δ = 2·layers·kv_heads·
head_dim·dtype_bytes (SPEC "KV memory"). Everything here is pure Python/NumPy.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from batcher.memory import KVMemory
from batcher.preemption import SwapLink
from cohort.units import GIB, dtype_bytes
from predictor.estimator import AnalyticBatchTime


@dataclass(frozen=True)
class GPU:
    """Peak numbers from vendor data sheets (dense fp16/bf16 tensor FLOP/s, HBM bandwidth)."""

    name: str
    memory_bytes: int
    flops: float
    bandwidth: float
    pcie_bandwidth: float = 12e9   # host<->device bytes/s each way, as pinned-memory copies reach it

    def swap_link(self) -> SwapLink:
        """The host↔device link swapped KV pages cross (AdaptiveLLM eq. 2)."""
        return SwapLink(self.pcie_bandwidth, self.pcie_bandwidth)


@dataclass(frozen=True)
class RooflineShape:
    """What the roofline needs from a model config: parameter count and the KV geometry."""

    name: str
    params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str = "float16"

    @property
    def dtype_bytes(self) -> int:
        return dtype_bytes(self.dtype)

    @property
    def weight_bytes(self) -> int:
        return int(self.params * self.dtype_bytes)

    @property
    def delta_bytes(self) -> int:
        """Δ = 2 · layers · kv_heads · head_dim · dtype_bytes."""
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes


GPUS: dict[str, GPU] = {
    # V100-SXM2-32GB: 125 TFLOP/s fp16 tensor, 900 GB/s HBM2 (Magnus's testbed); PCIe 3.0 x16
    # (15.8 GB/s raw, ~12 GB/s pinned copies).
    "v100-32gb": GPU("V100-32GB", 32 * GIB, 125e12, 900e9, 12e9),
    # A100-SXM4-80GB: 312 TFLOP/s bf16 dense, 2039 GB/s HBM2e; PCIe 4.0 x16 (31.5 raw, ~25 GB/s).
    "a100-80gb": GPU("A100-80GB", 80 * GIB, 312e12, 2039e9, 25e9),
    # A800-PCIe-80GB (AdaptiveLLM's testbed): the A100 PCIe part, 312 TFLOP/s bf16, 1935 GB/s; PCIe 4.0.
    "a800-80gb": GPU("A800-80GB", 80 * GIB, 312e12, 1935e9, 25e9),
    # H100-SXM5-80GB: 989 TFLOP/s bf16 dense, 3350 GB/s HBM3; PCIe 5.0 x16 (63 raw, ~50 GB/s).
    "h100-80gb": GPU("H100-80GB", 80 * GIB, 989e12, 3350e9, 50e9),
}

MODELS: dict[str, RooflineShape] = {
    # THUDM/chatglm-6b: 28 layers, hidden 4096, 32 heads (no MQA in v1), 6.17 B parameters.
    "chatglm-6b": RooflineShape("ChatGLM-6B", 6.173e9, 28, 4096, 32, 32, 128),
    # LLaMA-7B: 32 layers, hidden 4096, 32 heads, 6.74 B parameters.
    "llama-7b": RooflineShape("Llama-7B", 6.738e9, 32, 4096, 32, 32, 128),
    # LLaMA-13B (AdaptiveLLM's Llama-13B): 40 layers, hidden 5120, 40 heads, 13.02 B parameters.
    "llama-13b": RooflineShape("Llama-13B", 13.016e9, 40, 5120, 40, 40, 128),
    # meta-llama/Meta-Llama-3-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads (GQA) of 128, 8.03 B parameters
    # (the 128,256-token vocabulary's untied embeddings included), bf16: what the engine simulator models.
    "llama-3-8b": RooflineShape("Llama-3-8B", 8.030e9, 32, 4096, 32, 8, 128, dtype="bfloat16"),
    # The built-in model (cohort/tiny-random-llama, workers.tiny_llama.TINY_LLAMA) as a CPU worker runs it,
    # in fp32: 4 layers, hidden 128, 4 heads, 2 KV heads of 32; 4.50 M parameters, 3.9 M of them the
    # MiniLM vocabulary's (30,522) tied embeddings (tests/bench/test_roofline.py checks the match).
    "tiny": RooflineShape("tiny-random-llama", 4_497_792, 4, 128, 4, 2, 32, dtype="float32"),
}


@dataclass(frozen=True)
class RooflineBatchTime:
    """T(β, L, G) = overhead + prefill(β, L) + Σ_{g=1}^{G} max(compute(β), reads(β, L+g)) + G·step_overhead.

    ``compute_eff`` and ``bandwidth_eff`` are the fractions of peak that HF eager reaches;
    ``step_overhead_s`` is the per-token framework cost that dominates small batches.
    Satisfies ``batcher.policies.base.BatchTimeModel``.
    """

    flops: float
    bandwidth: float
    params: float
    weight_bytes: float
    delta_bytes: float
    layers: int
    hidden: int
    compute_eff: float       # the efficiency and overhead defaults are ``Instance``'s
    bandwidth_eff: float
    step_overhead_s: float
    batch_overhead_s: float

    @property
    def _F(self) -> float:
        return self.flops * self.compute_eff

    @property
    def _BW(self) -> float:
        return self.bandwidth * self.bandwidth_eff

    def prefill(self, size: float, input_len: float) -> float:
        """2·params·β·L FLOPs for the matmuls plus 2·layers·hidden·β·L² for causal attention."""
        return (2.0 * self.params * size * input_len
                + 2.0 * self.layers * self.hidden * size * input_len * input_len) / self._F

    def step_seconds(self, prefill_tokens: float, prefill_pairs: float, prefill_reads: float,
                     decode_rows: float, decode_reads: float) -> float:
        """One iteration of a continuous engine, unpadded: every token of the step goes through the
        weights once (2·params FLOPs each), prefill chunks add causal attention (a chunk of c tokens
        after p cached ones attends to ``prefill_pairs`` = c·(p + c/2) pairs, 4·layers·hidden FLOPs
        each, so a whole prompt costs ``prefill``'s 2·layers·hidden·L²), and the step reads the
        weights plus the KV each row attends to (``decode_reads`` + ``prefill_reads`` tokens · Δ).
        With no prefill it is exactly one of ``estimate``'s decode steps for the same rows."""
        flops = 2.0 * self.params * (prefill_tokens + decode_rows) + 4.0 * self.layers * self.hidden * prefill_pairs
        reads = self.weight_bytes + (decode_reads + prefill_reads) * self.delta_bytes
        return max(flops / self._F, reads / self._BW) + self.step_overhead_s

    def decode_seconds(self, rows: int, context_tokens: float) -> float:
        """One decode step of ``rows`` rows attending to ``context_tokens`` in all: the step cost
        ``batcher.row_cost`` weighs another row with (``DecodeStepCost``)."""
        return self.step_seconds(0.0, 0.0, 0.0, rows, context_tokens)

    def estimate(self, size: int, input_len: int, gen_len: int) -> float:
        """Scalar path in plain Python: the policies call it inside tight loops."""
        b, L, G = float(size), float(input_len), float(gen_len)
        t = self.batch_overhead_s + self.prefill(b, L)
        if G <= 0:
            return t
        A = 2.0 * self.params * b / self._F                      # compute time of one step
        B = (self.weight_bytes + b * L * self.delta_bytes) / self._BW  # reads at g = 0
        C = b * self.delta_bytes / self._BW                     # extra reads per generated token
        k = min(max(math.ceil((A - B) / C) - 1, 0), G) if A > B else 0  # steps that are compute-bound
        decode = k * A + (G - k) * B + C * (G * (G + 1) / 2.0 - k * (k + 1) / 2.0)
        return t + decode + G * self.step_overhead_s

    def estimate_many(self, shapes: Sequence[tuple[int, int, int]] | np.ndarray) -> np.ndarray:
        s = np.asarray(shapes, dtype=float).reshape(-1, 3)
        b, L, G = s[:, 0], s[:, 1], s[:, 2]
        t = self.batch_overhead_s + (2.0 * self.params * b * L + 2.0 * self.layers * self.hidden * b * L * L) / self._F
        A = 2.0 * self.params * b / self._F
        B = (self.weight_bytes + b * L * self.delta_bytes) / self._BW
        C = np.maximum(b * self.delta_bytes / self._BW, 1e-30)
        k = np.where(A > B, np.clip(np.ceil((A - B) / C) - 1, 0, G), 0.0)
        decode = k * A + (G - k) * B + C * (G * (G + 1) / 2.0 - k * (k + 1) / 2.0)
        return t + np.where(G > 0, decode + G * self.step_overhead_s, 0.0)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": "roofline", **asdict(self)}


@dataclass(frozen=True)
class Instance:
    """One LLM instance: a model shape on a GPU. Gives Θ/Δ (KVMemory) and the batch-time model."""

    gpu: GPU
    model: RooflineShape
    reserve_frac: float = 0.1
    compute_eff: float = 0.5
    bandwidth_eff: float = 0.8
    step_overhead_s: float = 0.01
    batch_overhead_s: float = 0.05
    theta_override: int | None = field(default=None)

    @property
    def theta_bytes(self) -> int:
        """Θ = device memory − weights − reserve (a fraction of device memory for activations)."""
        if self.theta_override is not None:
            return int(self.theta_override)
        free = self.gpu.memory_bytes - self.model.weight_bytes - int(self.reserve_frac * self.gpu.memory_bytes)
        if free <= 0:
            raise ValueError(f"{self.model.name} does not fit on {self.gpu.name}")
        return int(free)

    @property
    def memory(self) -> KVMemory:
        return KVMemory(delta_bytes=self.model.delta_bytes, theta_bytes=self.theta_bytes)

    def swap_link(self) -> SwapLink:
        return self.gpu.swap_link()

    def time_model(self) -> RooflineBatchTime:
        m = self.model
        return RooflineBatchTime(self.gpu.flops, self.gpu.bandwidth, m.params, m.weight_bytes, m.delta_bytes,
                                 m.layers, m.hidden, self.compute_eff, self.bandwidth_eff,
                                 self.step_overhead_s, self.batch_overhead_s)

    def describe(self) -> dict[str, Any]:
        return {"gpu": self.gpu.name, "model": self.model.name, "theta_bytes": self.theta_bytes,
                "delta_bytes": self.model.delta_bytes, "theta_tokens": self.theta_bytes // self.model.delta_bytes,
                "reserve_frac": self.reserve_frac, "compute_eff": self.compute_eff,
                "bandwidth_eff": self.bandwidth_eff, "step_overhead_s": self.step_overhead_s,
                "batch_overhead_s": self.batch_overhead_s, "pcie_bandwidth": self.gpu.pcie_bandwidth}


def instance(gpu: str = "v100-32gb", model: str = "chatglm-6b", **kw: Any) -> Instance:
    """A preset instance by name; the default is Magnus's testbed (ChatGLM-6B fp16, V100-32GB)."""
    try:
        g, m = GPUS[gpu.lower()], MODELS[model.lower()]
    except KeyError as e:
        raise ValueError(f"unknown preset {e.args[0]!r}; GPUs {sorted(GPUS)}, models {sorted(MODELS)}") from None
    return Instance(g, m, **kw)


def load_profile_samples(path: str | Path) -> tuple[list[tuple[int, int, int]], list[float]]:
    """Samples from ``cohort worker profile``: a JSON list of {size, input_len, gen_len, seconds}
    (or an object with a ``samples`` list of them)."""
    data = json.loads(Path(path).read_text())
    if isinstance(data, dict):
        data = data.get("samples", [])
    shapes = [(int(d["size"]), int(d["input_len"]), int(d["gen_len"])) for d in data]
    return shapes, [float(d["seconds"]) for d in data]


def fitted_time_model(path: str | Path) -> AnalyticBatchTime:
    """``AnalyticBatchTime`` fitted (NNLS) to profiled samples: the simulator's other batch-time model."""
    shapes, secs = load_profile_samples(path)
    if len(shapes) < 4:
        raise ValueError(f"{path}: need at least 4 profiled batches to fit, got {len(shapes)}")
    return AnalyticBatchTime.fit(shapes, secs)
