"""The HELR problem and the price of one placement (thesis §3.5): what a plan costs, which
layer counts a set of devices can hold, which of two plans a mode prefers.

Pure Python + NumPy. Inputs are plain arrays (see :class:`Problem`) so the search in
``deployer.helr`` can be tested against brute force (:func:`best_plan` over every order).

Cost model (ms for one token through the pipeline)::

    cost(order) = p * sum_i layers_i * m / perf_i  +  sum_k hop(order[k], order[k+1])

with ``m`` bytes per layer and ``p`` ms per byte at performance 1.0 (decode is
memory-bandwidth bound, so a layer's time is its bytes over the device's speed).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from cohort.units import GIB, KIB, MIB

MODES = ("he", "lr", "helr")


class DeploymentInfeasible(ValueError):
    """No device subset has room for the model (after the KV reserve)."""


@dataclass(frozen=True)
class Problem:
    """Everything HELR needs, as arrays indexed by device position 0..n-1."""

    mem: np.ndarray  # usable (free) bytes per device, before the KV reserve
    perf: np.ndarray  # relative performance, > 0
    hop: np.ndarray  # n x n hop latency (ms), symmetric, zero diagonal
    num_layers: int
    layer_bytes: int  # m
    first_bytes: int = 0  # embeddings etc., on the first pipeline device
    last_bytes: int = 0  # final norm + head, on the last pipeline device
    kv_reserve: int = 0  # T, kept free on every device
    p: float = 1.0 / 0.936e9  # ms per byte at perf 1.0
    ids: tuple[int, ...] = ()  # device ids for messages/output (default: positions)
    return_hop: bool = False  # head tied to the embedding: the token returns to the first device
    first_read_bytes: int = 0  # per-token weight reads outside blocks on the first device (tied head)
    last_read_bytes: int = 0  # per-token weight reads outside blocks on the last device (norm + head)

    def __post_init__(self) -> None:
        object.__setattr__(self, "mem", np.asarray(self.mem, dtype=np.int64))
        object.__setattr__(self, "perf", np.asarray(self.perf, dtype=float))
        object.__setattr__(self, "hop", np.asarray(self.hop, dtype=float))
        n = len(self.mem)
        if self.perf.shape != (n,) or self.hop.shape != (n, n):
            raise ValueError("mem, perf and hop sizes disagree")
        if np.any(self.perf <= 0):
            raise ValueError("performance must be positive")
        if not self.ids:
            object.__setattr__(self, "ids", tuple(range(n)))

    @property
    def n(self) -> int:
        return len(self.mem)

    @property
    def model_bytes(self) -> int:
        return self.num_layers * self.layer_bytes + self.first_bytes + self.last_bytes


@dataclass
class Plan:
    """A placement: devices (positions into the Problem) in pipeline order, layers each."""

    order: list[int]
    layers: list[int]
    compute_ms: float
    hop_ms: float
    mode: str = "lr"
    objective: float = 0.0
    used_bytes: list[int] = field(default_factory=list)

    @property
    def cost(self) -> float:
        return self.compute_ms + self.hop_ms

    @property
    def size(self) -> int:
        return len(self.order)


def rank_fastest(problem: Problem, members: list[int]) -> list[int]:
    """Fastest first; ties by more memory, then position (the thesis sorts by perf and memory)."""
    return sorted(members, key=lambda i: (-problem.perf[i], -problem.mem[i], i))


def fill(problem: Problem, members: list[int], first: int | None, last: int | None) -> dict[int, int] | None:
    """Layers per device: fastest first, each up to its cap; None if they don't fit.

    ``first``/``last`` lose the embedding/head bytes from their cap; pass None for both to
    get the relaxed fill used as a lower bound.
    """
    m, T = problem.layer_bytes, problem.kv_reserve
    rem = problem.num_layers
    out: dict[int, int] = {}
    for i in rank_fastest(problem, members):
        free = int(problem.mem[i]) - T
        if i == first:
            free -= problem.first_bytes
        if i == last:
            free -= problem.last_bytes
        if free < 0:
            return None
        cap = rem if m <= 0 else min(rem, free // m)
        out[i] = cap
        rem -= cap
    if rem > 0:
        return None
    return out


def useful(problem: Problem, layers: dict[int, int], first: int, last: int) -> bool:
    for i, k in layers.items():
        if k == 0 and not ((i == first and problem.first_bytes > 0) or (i == last and problem.last_bytes > 0)):
            return False
    return True


def compute_ms(problem: Problem, layers: dict[int, int], first: int | None, last: int | None) -> float:
    """p * (sum layers_i * m / perf_i + head reads / perf of the device holding the head).

    With ``first``/``last`` None (relaxed bound) the head is priced on the fastest member.
    """
    total = problem.layer_bytes * sum(k / problem.perf[i] for i, k in layers.items())
    top = max(problem.perf[i] for i in layers) if layers else 1.0
    f = problem.perf[first] if first is not None else top
    la = problem.perf[last] if last is not None else top
    total += problem.first_read_bytes / f + problem.last_read_bytes / la
    return float(problem.p * total)


def path_ms(problem: Problem, order: list[int]) -> float:
    """Hop latency along the pipeline (plus last -> first when the head is tied to the embedding)."""
    hops = path_ms_raw(problem.hop, order)
    if problem.return_hop and len(order) > 1:
        hops += float(problem.hop[order[-1], order[0]])
    return hops


def evaluate_order(problem: Problem, order: list[int]) -> tuple[float, dict[int, int]] | None:
    """Cost and layer counts of one pipeline order, or None if infeasible / wasteful."""
    layers = fill(problem, list(order), order[0], order[-1])
    if layers is None or not useful(problem, layers, order[0], order[-1]):
        return None
    return compute_ms(problem, layers, order[0], order[-1]) + path_ms(problem, order), layers


def objective(mode: str, cost: float, size: int, a1: float, a2: float) -> tuple[float, ...]:
    if mode == "he":
        return (size, cost)
    if mode == "lr":
        return (cost, size)
    if mode == "helr":
        return (a1 * cost + a2 * size, cost, size)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def make_plan(problem: Problem, order: list[int], layers: dict[int, int], mode: str,
               a1: float, a2: float) -> Plan:
    comp = compute_ms(problem, layers, order[0], order[-1])
    hops = path_ms(problem, order)
    used = []
    for pos, i in enumerate(order):
        b = layers[i] * problem.layer_bytes
        if pos == 0:
            b += problem.first_bytes
        if pos == len(order) - 1:
            b += problem.last_bytes
        used.append(b)
    obj = objective(mode, comp + hops, len(order), a1, a2)[0]
    return Plan(order=list(order), layers=[layers[i] for i in order], compute_ms=comp, hop_ms=hops,
                mode=mode, objective=float(obj), used_bytes=used)


def fmt_bytes(b: float) -> str:
    """Human-readable size (GiB for model-sized numbers, smaller units for toy models)."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{int(b)} B"


def infeasible_error(problem: Problem) -> DeploymentInfeasible:
    usable = np.maximum(problem.mem - problem.kv_reserve, 0)
    need = problem.model_bytes
    return DeploymentInfeasible(
        f"model does not fit: it needs {fmt_bytes(need)} ({problem.num_layers} layers x "
        f"{fmt_bytes(problem.layer_bytes)} + {fmt_bytes(problem.first_bytes)} embeddings + "
        f"{fmt_bytes(problem.last_bytes)} head), but the {problem.n} device(s) have only "
        f"{fmt_bytes(usable.sum())} usable in total after reserving {fmt_bytes(problem.kv_reserve)} "
        f"of KV cache on each (largest single device {fmt_bytes(usable.max(initial=0))}; whole layers "
        f"cannot be split across devices). Free memory, lower the KV reserve, or add GPUs."
    )


def path_ms_raw(hop: np.ndarray, order: list[int]) -> float:
    """Sum of the hops between consecutive devices of ``order``."""
    return float(sum(hop[a, b] for a, b in itertools.pairwise(order)))


def best_plan(problem: Problem, orders: Iterable[list[int]], mode: str, a1: float, a2: float) -> Plan | None:
    """The best of ``orders`` under the mode's objective (ties: the first), None if none is feasible.
    The heuristic's search; the tests' brute force gives it every order."""
    best: tuple[tuple[float, ...], list[int], dict[int, int]] | None = None
    for order in orders:
        r = evaluate_order(problem, order)
        if r is None:
            continue
        obj = objective(mode, r[0], len(order), a1, a2)
        if best is None or obj < best[0]:
            best = (obj, order, r[1])
    if best is None:
        return None
    return make_plan(problem, best[1], best[2], mode, a1, a2)
