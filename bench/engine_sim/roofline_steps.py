"""Step times and the KV pool from ``bench.roofline``: the simulator's default engine timing.

Its own module because ``bench.roofline`` brings the predictor's estimator (scikit-learn: a
second and more of start-up), which the fixed-delay engine and a ``--fit`` engine never need.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.engine_sim.step_time import StepShape
from bench.roofline import GPU, Instance, RooflineBatchTime, instance


@dataclass(frozen=True)
class RooflineStepTime:
    """A step on the roofline: ``RooflineBatchTime.step_seconds`` (FLOPs of every token through
    the weights plus the prefill chunks' attention, against the weights and the KV read)."""

    model: RooflineBatchTime
    label: str = "roofline"

    def seconds(self, shape: StepShape) -> float:
        return self.model.step_seconds(shape.prefill_tokens, shape.prefill_pairs, shape.prefill_context,
                                       shape.decode_rows, shape.decode_context)

    def front_seconds(self, prompt_tokens: int) -> float:
        """No front end: a GPU server's runs on other cores than its engine's."""
        return 0.0

    def describe(self) -> dict[str, Any]:
        return {"kind": "roofline", "label": self.label, "step_overhead_s": self.model.step_overhead_s,
                "compute_eff": self.model.compute_eff, "bandwidth_eff": self.model.bandwidth_eff}


def tp_instance(gpu: str, model: str, tp: int = 1, step_overhead_s: float = 0.002) -> Instance:
    """The roofline instance of ``model`` on ``tp`` GPUs of a kind: tensor parallelism modelled as
    one GPU with ``tp`` times the memory, FLOP/s and bandwidth (weights and KV heads are split;
    the all-reduces are not modelled). The step overhead defaults to 2 ms, a CUDA-graph engine's
    (the roofline's own default is HF eager's)."""
    base = instance(gpu, model, step_overhead_s=step_overhead_s)
    if tp == 1:
        return base
    g = base.gpu
    scaled = GPU(f"{tp}x{g.name}", g.memory_bytes * tp, g.flops * tp, g.bandwidth * tp, g.pcie_bandwidth)
    return Instance(scaled, base.model, step_overhead_s=step_overhead_s)


def roofline_step_time(gpu: str, model: str, tp: int = 1) -> RooflineStepTime:
    return RooflineStepTime(tp_instance(gpu, model, tp).time_model(), f"{model} on {tp}x {gpu}")


def default_num_blocks(gpu: str, model: str, tp: int, block_size: int) -> int:
    """What the roofline leaves for KV on the GPU(s) (Θ/Δ tokens: device memory − weights − a
    10 % reserve, as vLLM's 0.9 ``gpu_memory_utilization`` does), in blocks."""
    inst = tp_instance(gpu, model, tp)
    return max(2, inst.theta_bytes // inst.model.delta_bytes // block_size)
