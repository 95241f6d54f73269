"""HELR: choose GPUs, a pipeline order and layer counts for one model (thesis §3.5).

The search; what a placement costs (the problem, the fill, the objective) is
``deployer.helr_cost``, so the search can be tested against brute force without torch.

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

from collections.abc import Iterator

import numpy as np

from deployer.helr_cost import (
    MODES,
    Plan,
    Problem,
    best_plan,
    compute_ms,
    fill,
    infeasible_error,
    make_plan,
    objective,
    path_ms_raw,
    useful,
)

EXACT_LIMIT = 12

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
                if best is not None and objective(mode, base_cost + hops, k, a1, a2) >= best[0]:
                    break  # pairs are sorted by hop cost, so no later pair can do better
                layers = base if (problem.first_bytes == 0 and problem.last_bytes == 0) else \
                    fill(problem, members, s, e)
                if layers is None or not useful(problem, layers, s, e):
                    continue
                obj = objective(mode, compute_ms(problem, layers, s, e) + hops, k, a1, a2)
                if best is None or obj < best[0]:
                    best = (obj, mask, s, e, layers)
    if best is None:
        return None
    _, mask, s, e, layers = best
    return make_plan(problem, _walk_back(prev, s, mask, e), layers, mode, a1, a2)


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
        raise infeasible_error(problem)
    return plan
