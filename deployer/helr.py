"""HELR: choose GPUs, a pipeline order and layer counts for one model (thesis §3.5).

Pure Python + NumPy. Inputs are plain arrays (see :class:`Problem`) so the search can be
tested against brute force (tests/deployer) without torch.

Cost model (ms for one token through the pipeline)::

    cost(order) = p * sum_i layers_i * m / perf_i  +  sum_k hop(order[k], order[k+1])

with ``m`` bytes per layer and ``p`` ms per byte at performance 1.0 (decode is
memory-bandwidth bound, so a layer's time is its bytes over the device's speed).

Search, exactly as the thesis describes but made exact about the pipeline ends:

1. every device subset S whose usable memory sum(mem_i - T) covers the model;
2. for each ordered pair (first, last) of S - the first device also holds the embeddings,
   the last the final norm and head, so their caps shrink by those bytes - layers are
   given to the fastest devices first, each up to floor((mem_i - T - extras_i) / m)
   (greedy fastest-first is optimal for the compute term under per-device caps);
3. the cheapest pipeline order from ``first`` to ``last`` through all of S is read from a
   bitmask DP over (visited set, last device) on the hop matrix - one Held-Karp table per
   start device covers every subset at once;
4. modes: ``he`` = fewest devices, then lowest cost; ``lr`` = lowest cost (then fewer
   devices); ``helr`` = lowest ``a1 * cost + a2 * |S|``.

A subset in which some device would receive no layers and no embeddings/head is skipped:
it is the smaller subset plus a useless hop.

Exact for up to :data:`EXACT_LIMIT` devices (the DP tables are n * 2^n * n). Above that a
heuristic is used (:func:`_solve_heuristic`): candidate subsets are the prefixes of the
devices ranked by performance, by memory, by performance x memory, and "locality-grown"
sets (from each seed, repeatedly add the device with the cheapest hop to the set); each
candidate is ordered by nearest-neighbour from every start device, the best orders are
improved by 2-opt, and the same fill and cost are applied. It is not guaranteed optimal.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from cohort.units import GIB, KIB, MIB

EXACT_LIMIT = 12
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


# --------------------------------------------------------------------------------------------
# Fill and evaluation (shared by the DP, the heuristic and the tests' brute-force oracle)
# --------------------------------------------------------------------------------------------


def _rank(problem: Problem, members: list[int]) -> list[int]:
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
    for i in _rank(problem, members):
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


def _useful(problem: Problem, layers: dict[int, int], first: int, last: int) -> bool:
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
    if layers is None or not _useful(problem, layers, order[0], order[-1]):
        return None
    return compute_ms(problem, layers, order[0], order[-1]) + path_ms(problem, order), layers


def _objective(mode: str, cost: float, size: int, a1: float, a2: float) -> tuple[float, ...]:
    if mode == "he":
        return (size, cost)
    if mode == "lr":
        return (cost, size)
    if mode == "helr":
        return (a1 * cost + a2 * size, cost, size)
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _make_plan(problem: Problem, order: list[int], layers: dict[int, int], mode: str,
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
    obj = _objective(mode, comp + hops, len(order), a1, a2)[0]
    return Plan(order=list(order), layers=[layers[i] for i in order], compute_ms=comp, hop_ms=hops,
                mode=mode, objective=float(obj), used_bytes=used)


def fmt_bytes(b: float) -> str:
    """Human-readable size (GiB for model-sized numbers, smaller units for toy models)."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if abs(b) >= size:
            return f"{b / size:.2f} {unit}"
    return f"{int(b)} B"


def _infeasible(problem: Problem) -> DeploymentInfeasible:
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


# --------------------------------------------------------------------------------------------
# Exact: Held-Karp path tables + subset enumeration
# --------------------------------------------------------------------------------------------


def path_tables(hop: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Held-Karp over (visited set, last device), one table per start device.

    ``dist[s, mask, e]`` is the cheapest path that starts at ``s``, visits exactly the
    devices in ``mask`` and ends at ``e``; ``prev[s, mask, e]`` is the device before ``e``.
    Built layer by layer (by popcount) and vectorised over all masks of a layer.
    """
    n = hop.shape[0]
    full = 1 << n
    dist = np.full((n, full, n), np.inf)
    prev = np.full((n, full, n), -1, dtype=np.int8)
    for s in range(n):
        dist[s, 1 << s, s] = 0.0
    masks = np.arange(full)
    popcount = np.array([bin(x).count("1") for x in range(full)])
    for k in range(1, n):
        layer = masks[popcount == k]
        for j in range(n):
            src = layer[(layer >> j) & 1 == 0]
            if src.size == 0:
                continue
            cand = dist[:, src, :] + hop[:, j][None, None, :]  # (start, mask, end) -> + hop(end, j)
            best_e = np.argmin(cand, axis=2)
            val = np.take_along_axis(cand, best_e[..., None], axis=2)[..., 0]
            dst = src | (1 << j)
            dist[:, dst, j] = val
            prev[:, dst, j] = np.where(np.isfinite(val), best_e, -1)
    return dist, prev


def _walk_back(prev: np.ndarray, s: int, mask: int, e: int) -> list[int]:
    order = [e]
    while mask != (1 << s) or e != s:
        p = int(prev[s, mask, e])
        mask &= ~(1 << e)
        e = p
        order.append(e)
    return order[::-1]


def _solve_exact(problem: Problem, mode: str, a1: float, a2: float) -> Plan | None:
    n = problem.n
    dist, prev = path_tables(problem.hop)
    usable = problem.mem - problem.kv_reserve
    need = problem.model_bytes
    best: tuple[tuple[float, ...], int, int, int, dict[int, int]] | None = None
    by_size: dict[int, list[int]] = {}
    for mask in range(1, 1 << n):
        by_size.setdefault(bin(mask).count("1"), []).append(mask)
    for k in range(1, n + 1):
        if mode == "he" and best is not None:
            break  # fewest devices wins; a feasible smaller set was found
        for mask in by_size.get(k, []):
            members = [i for i in range(n) if mask >> i & 1]
            if usable[members].sum() < need:
                continue
            base = fill(problem, members, None, None)
            if base is None:
                continue
            base_cost = compute_ms(problem, base, None, None)
            pairs = [(s, e) for s in members for e in members if (s != e) or k == 1]
            def pair_hops(se: tuple[int, int], mask: int = mask) -> float:
                s, e = se
                back = problem.hop[e, s] if problem.return_hop and s != e else 0.0
                return float(dist[s, mask, e] + back)

            pairs.sort(key=pair_hops)
            for s, e in pairs:
                hops = pair_hops((s, e))
                if not np.isfinite(hops):
                    continue
                if best is not None and _objective(mode, base_cost + hops, k, a1, a2) >= best[0]:
                    break  # pairs are sorted by hop cost, so no later pair can do better
                layers = base if (problem.first_bytes == 0 and problem.last_bytes == 0) else \
                    fill(problem, members, s, e)
                if layers is None or not _useful(problem, layers, s, e):
                    continue
                obj = _objective(mode, compute_ms(problem, layers, s, e) + hops, k, a1, a2)
                if best is None or obj < best[0]:
                    best = (obj, mask, s, e, layers)
    if best is None:
        return None
    _, mask, s, e, layers = best
    return _make_plan(problem, _walk_back(prev, s, mask, e), layers, mode, a1, a2)


# --------------------------------------------------------------------------------------------
# Heuristic above EXACT_LIMIT devices
# --------------------------------------------------------------------------------------------


def _two_opt(hop: np.ndarray, order: list[int]) -> list[int]:
    """Reverse segments while that shortens the open path (first-improvement 2-opt)."""
    order = list(order)
    improved = True
    while improved:
        improved = False
        for i in range(len(order) - 1):
            for j in range(i + 1, len(order)):
                cand = order[:i] + order[i:j + 1][::-1] + order[j + 1:]
                if path_ms_raw(hop, cand) < path_ms_raw(hop, order) - 1e-12:
                    order, improved = cand, True
    return order


def path_ms_raw(hop: np.ndarray, order: list[int]) -> float:
    """Sum of the hops between consecutive devices of ``order``."""
    return float(sum(hop[a, b] for a, b in itertools.pairwise(order)))


def _nearest_neighbour(hop: np.ndarray, perf: np.ndarray, members: list[int], start: int) -> list[int]:
    order, left = [start], set(members) - {start}
    while left:
        cur = order[-1]
        nxt = min(left, key=lambda j: (hop[cur, j], -perf[j], j))
        order.append(nxt)
        left.remove(nxt)
    return order


def _candidate_subsets(problem: Problem) -> list[list[int]]:
    n = problem.n
    idx = list(range(n))
    rankings = [
        sorted(idx, key=lambda i: (-problem.perf[i], -problem.mem[i], i)),
        sorted(idx, key=lambda i: (-problem.mem[i], -problem.perf[i], i)),
        sorted(idx, key=lambda i: (-problem.perf[i] * problem.mem[i], i)),
    ]
    for seed in idx:
        grown, left = [seed], set(idx) - {seed}
        while left:
            nxt = min(left, key=lambda j: (min(problem.hop[g, j] for g in grown), -problem.perf[j], j))
            grown.append(nxt)
            left.remove(nxt)
        rankings.append(grown)
    seen: set[frozenset[int]] = set()
    out = []
    for r in rankings:
        for k in range(1, n + 1):
            s = frozenset(r[:k])
            if s not in seen:
                seen.add(s)
                out.append(sorted(s))
    return out


def _heuristic_orders(problem: Problem) -> Iterator[list[int]]:
    """Candidate pipeline orders: nearest-neighbour tours of the candidate subsets, 2-opted, both ways."""
    usable = problem.mem - problem.kv_reserve
    for members in _candidate_subsets(problem):
        if usable[members].sum() < problem.model_bytes or fill(problem, members, None, None) is None:
            continue
        orders = [_nearest_neighbour(problem.hop, problem.perf, members, s) for s in members]
        orders.sort(key=lambda o: path_ms_raw(problem.hop, o))
        for o in orders[:3]:
            o = _two_opt(problem.hop, o)
            yield o
            yield o[::-1]


def best_plan(problem: Problem, orders: Iterable[list[int]], mode: str, a1: float, a2: float) -> Plan | None:
    """The best of ``orders`` under the mode's objective (ties: the first), None if none is feasible.
    The heuristic's search; the tests' brute force gives it every order."""
    best: tuple[tuple[float, ...], list[int], dict[int, int]] | None = None
    for order in orders:
        r = evaluate_order(problem, order)
        if r is None:
            continue
        obj = _objective(mode, r[0], len(order), a1, a2)
        if best is None or obj < best[0]:
            best = (obj, order, r[1])
    if best is None:
        return None
    return _make_plan(problem, best[1], best[2], mode, a1, a2)


def _solve_heuristic(problem: Problem, mode: str, a1: float, a2: float) -> Plan | None:
    return best_plan(problem, _heuristic_orders(problem), mode, a1, a2)


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def solve(problem: Problem, mode: str = "helr", a1: float = 1.0, a2: float = 1.0) -> Plan:
    """Best plan for ``mode``; raises :class:`DeploymentInfeasible` when nothing fits.

    ``a1``/``a2`` only matter for ``helr``: one more device must save more than a2/a1 ms of
    cost to be worth using. The thesis's HE is a1 = 0 (devices only) and LR a1 >> a2.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if problem.num_layers <= 0:
        raise ValueError("model has no layers")
    if a1 < 0 or a2 < 0:
        raise ValueError("a1 and a2 must be non-negative")
    plan = (_solve_exact if problem.n <= EXACT_LIMIT else _solve_heuristic)(problem, mode, a1, a2)
    if plan is None:
        raise _infeasible(problem)
    return plan
