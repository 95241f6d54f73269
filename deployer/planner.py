"""Glue: cluster + model shape -> HELR plan, device_map and the two baselines.

This is what both the CLI and the worker call. The worker-facing entry point is
:func:`plan_device_map`, which returns ``None`` on machines without CUDA so the worker
simply loads on the CPU there.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deployer.cluster import GB, Cluster
from deployer.device_map import MapCost, balanced_map, evaluate_map, even_split_map, plan_map, usable_memory
from deployer.helr import solve
from deployer.helr_cost import MODES, Plan, Problem
from deployer.model_shape import ModelShape, load_model_shape
from deployer.topology import load_cluster

log = logging.getLogger(__name__)

#: Default KV-cache reserve T per device when none is given: enough for a moderate batch of
#: a 7B model at fp16 (2 GiB ~ 4k tokens of Llama-7B KV).
DEFAULT_KV_RESERVE_BYTES = 2 * GB

#: Tokens whose activations cross each hop in the cost model (1 = one decode step).
DEFAULT_HOP_TOKENS = 1


def build_problem(cluster: Cluster, shape: ModelShape, kv_reserve_bytes: int = DEFAULT_KV_RESERVE_BYTES,
                  hop_tokens: int = DEFAULT_HOP_TOKENS) -> Problem:
    """The HELR problem for ``shape`` on ``cluster`` (hop = link latency + activation transfer)."""
    act_bytes = (shape.hidden_size or 0) * shape.dtype_bytes * hop_tokens
    return Problem(
        mem=np.array([d.memory_bytes for d in cluster.devices], dtype=np.int64),
        perf=np.array([d.perf for d in cluster.devices], dtype=float),
        hop=cluster.hop_matrix_ms(act_bytes),
        num_layers=shape.num_layers,
        layer_bytes=shape.bytes_per_layer,
        first_bytes=shape.first_bytes,
        last_bytes=shape.last_bytes,
        kv_reserve=int(kv_reserve_bytes),
        p=cluster.p_ms_per_gb / GB,
        ids=tuple(cluster.ids),
        return_hop=any(u.tied_to_pre for u in shape.units),
        first_read_bytes=shape.first_read_bytes,
        last_read_bytes=shape.last_read_bytes,
    )


@dataclass
class Deployment:
    """A planned deployment with its baselines, ready to print or serialise."""

    mode: str
    cluster: Cluster
    shape: ModelShape
    problem: Problem
    plan: Plan
    device_map: dict[str, int]
    evaluation: MapCost
    baselines: dict[str, tuple[dict[str, Any], MapCost | None]]

    @property
    def devices(self) -> list[int]:
        return [self.problem.ids[i] for i in self.plan.order]

    @property
    def predicted_cost(self) -> float:
        return self.evaluation.cost

    def to_json(self) -> dict[str, Any]:
        """The CLI's JSON document (keys fixed by the issue)."""
        return {
            "mode": self.mode,
            "devices": self.devices,
            "layers_per_device": {str(d): int(k) for d, k in zip(self.devices, self.plan.layers, strict=True)},
            "device_map": self.device_map,
            "predicted_cost": round(self.predicted_cost, 6),
            "baselines": {
                name: {"device_map": dmap, "predicted_cost": None if ev is None else round(ev.cost, 6)}
                for name, (dmap, ev) in self.baselines.items()
            },
        }


def plan_deployment(shape: ModelShape, cluster: Cluster, mode: str = "helr", a1: float = 1.0, a2: float = 1.0,
                    kv_reserve_bytes: int | None = None, baselines: bool = True) -> Deployment:
    """Solve HELR for ``shape`` on ``cluster`` and price the even/balanced baselines alike."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    kv = DEFAULT_KV_RESERVE_BYTES if kv_reserve_bytes is None else int(kv_reserve_bytes)
    problem = build_problem(cluster, shape, kv)
    plan = solve(problem, mode, a1, a2)
    dmap = plan_map(shape, problem, plan)
    ev = evaluate_map(shape, problem, dmap)
    base: dict[str, tuple[dict[str, Any], MapCost | None]] = {}
    if baselines:
        even = even_split_map(shape, list(problem.ids))
        base["even"] = (even, evaluate_map(shape, problem, even))
        try:
            bal = balanced_map(shape, usable_memory(problem))
            base["balanced"] = (bal, evaluate_map(shape, problem, bal))
        except Exception as exc:  # noqa: BLE001 - a baseline must never break planning
            log.warning("accelerate balanced map failed: %s", exc)
            base["balanced"] = ({}, None)
    return Deployment(mode=mode, cluster=cluster, shape=shape, problem=problem, plan=plan, device_map=dmap,
                      evaluation=ev, baselines=base)


def plan_device_map(model_path: str, mode: str, topology_file: str | None = None, gpus_file: str | None = None,
                    kv_reserve_bytes: int | None = None, *, a1: float = 1.0, a2: float = 1.0,
                    dtype: str | None = None, require_cuda: bool = True,
                    trust_remote_code: bool = False) -> dict[str, int] | None:
    """The device_map a worker should pass to ``from_pretrained(..., device_map=...)``.

    Uses ``topology_file`` (nvidia-smi topo text or YAML) and ``gpus_file`` (nvidia-smi csv)
    when given, else probes the local GPUs. Returns None when no CUDA GPU is present (the
    worker then runs on the CPU); ``require_cuda=False`` plans from the files anyway (tests,
    planning for another machine). Raises :class:`~deployer.helr.DeploymentInfeasible`
    when no device subset can hold the model. Device ids are nvidia-smi indices; run the
    worker with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so they match CUDA ordinals.
    """
    if require_cuda:
        if not torch.cuda.is_available():
            log.info("no CUDA device: not planning a device_map")
            return None
    cluster = load_cluster(topology_file, gpus_file)
    shape = load_model_shape(Path(model_path), dtype=dtype, trust_remote_code=trust_remote_code)
    dep = plan_deployment(shape, cluster, mode=mode, a1=a1, a2=a2, kv_reserve_bytes=kv_reserve_bytes,
                          baselines=False)
    log.info("HELR %s plan: devices %s, layers %s, predicted %.3f ms/token", mode, dep.devices,
             dep.plan.layers, dep.predicted_cost)
    return dep.device_map
