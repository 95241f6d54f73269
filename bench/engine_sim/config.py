"""The simulator's options, what they imply (the KV pool size, the step-time model), and the
engine they build.

Defaults are vLLM's where vLLM has one (block size 16, ``max_num_seqs`` 256, a token budget of
8192 per step with chunked prefill on). The stepped engine is handed its step-time model and its
KV pool size (``cli.make_server`` takes them from the roofline, ``roofline_steps``, or from
``--fit`` and ``--num-gpu-blocks``), so that building the fixed-delay engine never loads the
roofline.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from bench.engine_sim.engine import SimClock, SteppedEngine
from bench.engine_sim.faults import Faults
from bench.engine_sim.fixed import FixedDelayEngine
from bench.engine_sim.kv_blocks import KVCacheManager
from bench.engine_sim.scheduler import FCFS, PRIORITY, Scheduler
from bench.engine_sim.step_time import StepTime


@dataclass
class SimConfig:
    model_name: str = "sim-model"
    tokenizer: str | None = None          # None: cohort's built-in model's tokenizer
    gpu: str = "h100-80gb"
    model: str = "llama-3-8b"
    tp: int = 1
    fit: str | None = None                # a fitted step-time JSON instead of the roofline
    num_gpu_blocks: int | None = None
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    scheduling_policy: str = FCFS
    enable_prefix_caching: bool = True
    speedup: float = 1.0
    ttft_ms: float | None = None          # both set: the fixed-delay engine
    itl_ms: float | None = None
    max_waiting: int = 0                  # 0: unbounded
    die_after: int = 0
    stall_after: int = 0
    stall_s: float = 0.0
    error_rate: float = 0.0
    seed: int = 0
    api_key: str | None = None            # vLLM's --api-key: /v1 routes answer 401 without it

    @property
    def fixed_delay(self) -> bool:
        return self.ttft_ms is not None or self.itl_ms is not None

    def validate(self) -> None:
        if self.fixed_delay and (self.ttft_ms is None or self.itl_ms is None):
            raise ValueError("the fixed-delay engine needs both --ttft-ms and --itl-ms")
        if self.scheduling_policy not in (FCFS, PRIORITY):
            raise ValueError(f"--scheduling-policy must be {FCFS} or {PRIORITY}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
        if self.speedup <= 0:
            raise ValueError("--speedup must be positive")

    def describe(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k != "api_key"}  # a secret is never echoed


def build_engine(cfg: SimConfig, step_time: StepTime | None = None, num_blocks: int | None = None,
                 exit_fn: Any = None) -> SteppedEngine | FixedDelayEngine:
    """The engine the options describe: the fixed-delay one when ``--ttft-ms``/``--itl-ms`` are
    set, else the stepped one, on ``step_time`` with ``num_blocks`` KV blocks
    (``cfg.num_gpu_blocks`` when not given)."""
    cfg.validate()
    clock = SimClock(cfg.speedup)
    kw = {"exit_fn": exit_fn} if exit_fn is not None else {}
    faults = Faults(cfg.die_after, cfg.stall_after, cfg.stall_s, cfg.error_rate, cfg.seed, **kw)
    if cfg.fixed_delay:
        assert cfg.ttft_ms is not None and cfg.itl_ms is not None
        return FixedDelayEngine(cfg.ttft_ms, cfg.itl_ms, clock, faults, cfg.max_waiting)
    blocks = num_blocks or cfg.num_gpu_blocks
    if step_time is None or not blocks:
        raise ValueError("the stepped engine needs a step-time model and a KV pool size")
    capacity = (blocks - 1) * cfg.block_size
    if cfg.max_model_len > capacity:
        raise ValueError(f"--max-model-len {cfg.max_model_len} exceeds the KV pool ({blocks} blocks of "
                         f"{cfg.block_size} = {capacity} usable tokens); lower it or raise --num-gpu-blocks")
    kv = KVCacheManager(blocks, cfg.block_size, cfg.max_model_len, cfg.enable_prefix_caching)
    sched = Scheduler(kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.scheduling_policy)
    return SteppedEngine(sched, step_time, clock, faults, cfg.max_waiting)
