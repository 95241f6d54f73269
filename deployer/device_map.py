"""Turn placements into HF ``device_map`` dicts, and price any device_map.

Three maps are produced for the same model and cluster so they can be compared under one
cost model:

* the HELR plan (:func:`plan_to_device_map`): contiguous blocks in pipeline order,
  embeddings (and rotary tables, tied heads) on the first device, final norm + head on the
  last;
* the even split (:func:`even_split_map`): every device in id order, layers divided as
  evenly as possible - what a naive pipeline does;
* accelerate's ``"balanced"`` map (:func:`balanced_map`): ``get_balanced_memory`` +
  ``infer_auto_device_map`` on the meta model, which is what ``device_map="balanced"``
  gives in ``from_pretrained``.

:func:`evaluate_map` prices any of them by following the token through the map's units in
execution order (pre modules, blocks 0..L-1, post modules).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np
import torch
from accelerate import infer_auto_device_map
from accelerate.utils import get_balanced_memory

from deployer.helr_cost import Plan, Problem
from deployer.model_shape import ModelShape, Unit

#: Relative performance and hop latency (ms) assumed for modules accelerate puts on the CPU
#: (only happens when the GPUs are too small; such maps are flagged as not fitting).
CPU_PERF = 0.05
CPU_HOP_MS = 0.5

DeviceMap = dict[str, "int | str"]


def plan_to_device_map(shape: ModelShape, device_ids: list[int], layers: list[int]) -> dict[str, int]:
    """HF device_map for a pipeline: ``layers[k]`` consecutive blocks on ``device_ids[k]``."""
    if sum(layers) != shape.num_layers:
        raise ValueError(f"plan places {sum(layers)} layers, model has {shape.num_layers}")
    owner: list[int] = []
    for dev, k in zip(device_ids, layers, strict=True):
        owner.extend([dev] * k)
    first, last = device_ids[0], device_ids[-1]
    out: dict[str, int] = {}
    for u in shape.units:
        if u.role == "layer":
            out[u.name] = owner[u.layer_index or 0]
        else:
            out[u.name] = first if u.on_first else last
    return out


def even_split_layers(num_layers: int, n_devices: int) -> list[int]:
    """L // n per device, the remainder to the first devices (devices with 0 are dropped)."""
    base, rem = divmod(num_layers, n_devices)
    return [base + (1 if i < rem else 0) for i in range(n_devices) if base + (1 if i < rem else 0) > 0]


def even_split_map(shape: ModelShape, device_ids: list[int]) -> dict[str, int]:
    """The naive pipeline: all devices in id order, equal layer counts."""
    layers = even_split_layers(shape.num_layers, len(device_ids))
    return plan_to_device_map(shape, sorted(device_ids)[: len(layers)], layers)


def balanced_map(shape: ModelShape, max_memory: dict[int, int]) -> DeviceMap:
    """accelerate's "balanced" map for the meta model with the given per-device budgets."""
    if shape.model is None:
        raise ValueError("balanced map needs the meta model (ModelShape.model)")
    dtype = {2: torch.float16, 4: torch.float32, 1: torch.int8, 8: torch.float64}[shape.dtype_bytes]
    log = logging.getLogger("accelerate.utils.modeling")
    level = log.level
    log.setLevel(logging.ERROR)  # "Device N is not available" when planning for another machine
    try:
        budget = get_balanced_memory(shape.model, max_memory=dict(max_memory),
                                     no_split_module_classes=shape.no_split_module_classes, dtype=dtype)
        dmap = infer_auto_device_map(shape.model, max_memory=budget,
                                     no_split_module_classes=shape.no_split_module_classes, dtype=dtype)
    finally:
        log.setLevel(level)
    return dict(dmap)


def resolve(device_map: DeviceMap, name: str) -> int | str | None:
    """Device of module/parameter ``name``: the longest key that is ``name`` or a prefix of it."""
    best: tuple[int, int | str] | None = None
    for key, dev in device_map.items():
        if key == "" or name == key or name.startswith(key + "."):
            if best is None or len(key) > best[0]:
                best = (len(key), dev)
    return None if best is None else best[1]


def validate_device_map(tensor_names: list[str], device_map: DeviceMap) -> list[str]:
    """Problems with ``device_map``: keys nested in other keys, tensors matched 0 or >1 times.

    Returns a list of messages (empty = every tensor is placed by exactly one entry).
    """
    problems = []
    keys = sorted(device_map)
    for a in keys:
        for b in keys:
            if a != b and (a == "" or b.startswith(a + ".")):
                problems.append(f"entry {b!r} is inside entry {a!r}")
    for t in tensor_names:
        hits = [k for k in keys if k == "" or t == k or t.startswith(k + ".")]
        if len(hits) != 1:
            problems.append(f"tensor {t!r} matched {len(hits)} entries {hits}")
    return problems


@dataclass
class MapCost:
    """A device_map priced under the HELR cost model."""

    cost: float
    compute_ms: float
    hop_ms: float
    order: list[int | str]  # devices in the order the token visits them
    layers: dict[int | str, int]
    used_bytes: dict[int | str, int]
    over_budget: list[int | str] = field(default_factory=list)  # devices past mem - T (or not GPUs)

    @property
    def fits(self) -> bool:
        return not self.over_budget


def evaluate_map(shape: ModelShape, problem: Problem, device_map: DeviceMap) -> MapCost:
    """Price ``device_map``: p * sum layers * m / perf + hops along the execution order.

    Uses the same m, p, perf and hop matrix as HELR, so the numbers are comparable. Modules on
    non-GPU devices ("cpu", "disk") are priced at :data:`CPU_PERF` / :data:`CPU_HOP_MS`.
    """
    pos = {dev: i for i, dev in enumerate(problem.ids)}

    def perf(d: int | str) -> float:
        return float(problem.perf[pos[d]]) if d in pos else CPU_PERF

    def hop(a: int | str, b: int | str) -> float:
        if a == b:
            return 0.0
        if a in pos and b in pos:
            return float(problem.hop[pos[a], pos[b]])
        return CPU_HOP_MS

    def dev_of(u: Unit) -> int | str:
        d = resolve(device_map, u.name)
        if d is None:
            raise ValueError(f"device_map does not place {u.name!r}")
        return d

    flow: list[Unit] = [u for u in shape.units if u.role == "pre" and not u.buffer_only]
    flow += shape.layers
    flow += [u for u in shape.units if u.role == "post" and not u.buffer_only]
    visits: list[int | str] = []
    for u in flow:
        d = dev_of(u)
        if not visits or visits[-1] != d:
            visits.append(d)
    hops = sum(hop(a, b) for a, b in zip(visits, visits[1:], strict=False))
    layers: dict[int | str, int] = {}
    for u in shape.layers:
        d = dev_of(u)
        layers[d] = layers.get(d, 0) + 1
    compute = sum(problem.p * problem.layer_bytes * k / perf(d) for d, k in layers.items())
    compute += sum(problem.p * u.read_bytes / perf(dev_of(u)) for u in shape.units if u.role == "post")
    used: dict[int | str, int] = {}
    for u in shape.units:
        d = dev_of(u)
        used[d] = used.get(d, 0) + u.bytes
    over = [d for d, b in used.items() if d not in pos or b > int(problem.mem[pos[d]]) - problem.kv_reserve]
    order = list(dict.fromkeys(visits))
    return MapCost(cost=float(compute + hops), compute_ms=float(compute), hop_ms=float(hops), order=order,
                   layers=layers, used_bytes=used, over_budget=over)


def plan_map(shape: ModelShape, problem: Problem, plan: Plan) -> dict[str, int]:
    """device_map of a :class:`~deployer.helr.Plan` (positions translated to device ids)."""
    ids = [problem.ids[i] for i in plan.order]
    return plan_to_device_map(shape, ids, plan.layers)


def usable_memory(problem: Problem) -> dict[int, int]:
    """Per-device budget mem - T, the max_memory handed to accelerate for the balanced map."""
    return {dev: int(max(m - problem.kv_reserve, 0)) for dev, m in zip(problem.ids, np.asarray(problem.mem),
                                                                       strict=True)}
