"""WMA-driven adaptive batch assembly (Magnus) and the policies built on it: GLP, ABP, Magnus.

On arrival of p, for every waiting batch B with p's key compute WMA(B ∪ {p}) with predicted
lengths, infinite when B ∪ {p} does not fit Θ (or β would pass a fixed cap); take the minimum φ;
if φ < Φ insert p there, else open a new batch. "Fits" is the one memory rule
(``batcher.memory``) on planned lengths: MEM(B) under static execution, the KV peak under
elastic execution.

WMA of member p simplifies to G_B·L_B + T(G_B) − (G_p·L_p + T(G_p)) with T(x) = x(x+1)/2,
so WMA(B) = G_B·L_B + T(G_B) − min_p (G_p·L_p + T(G_p)): each batch keeps three numbers and an
insertion test is O(1) per batch (tests check this against the literal definition).

Speed: the simulator drives tens of thousands of arrivals against hundreds of open batches under
overload, so those numbers also live in NumPy columns (L, G, min useful, size, key id, oldest
arrival) and one insertion is a handful of vectorised operations over all open batches; HRRN
(``base.response_ratios``) reads the same columns instead of recomputing max/min over every
member of every batch.
Behaviour (including ties: the first batch in opening order wins) is the same as the loop.
Under elastic planning the columns also hold each batch's KV peak and planned-length range, and
``batcher.kv_judge.grow_bounds`` settles most batches at once; the few it cannot settle are
tested exactly (``KVPlan.fits_with``, the batch's sorted planned lengths) in φ order, stopping
at the first that fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from batcher.kv_judge import KVPlan, grow_bounds
from batcher.policies.base import NextOpen, Order, Policy, PolicyContext, Rank, hrrn_first, response_ratios
from cohort.types import Batch, ProfiledRequest, new_id


def _tri(x: int) -> int:
    return x * (x + 1) // 2


def _useful(L: int, G: int) -> int:
    """G·L + T(G): the reads a member needs for itself; WMA is the batch total minus this."""
    return G * L + _tri(G)


@dataclass
class _Open:
    batch: Batch
    L: int
    G: int
    min_useful: int
    plan: KVPlan | None = None

    def wma_with(self, L: int, G: int) -> tuple[int, int, int]:
        L_B, G_B = max(self.L, L), max(self.G, G)
        return _useful(L_B, G_B) - min(self.min_useful, _useful(L, G)), L_B, G_B


class WMAPolicy(Policy):
    """Adaptive assembly under Φ and Θ; ``max_batch_size`` caps β (GLP); ``order`` picks the batch."""

    # WMA (predicted lengths): L, G, min useful; memory (planned lengths): P = largest, pmin =
    # smallest, peak KV tokens and its rank kpk; size, batch key id, oldest arrival.
    _COLS = ("L", "G", "mu", "size", "key", "oldest", "P", "pmin", "peak", "kpk")

    def __init__(self, ctx: PolicyContext, threshold: float, max_batch_size: int | None = None,
                 order: Order = "oldest") -> None:
        super().__init__(ctx)
        if order not in ("oldest", "hrrn"):
            raise ValueError(f"order must be oldest or hrrn, not {order!r}")
        self.threshold = threshold
        self.max_batch_size = max_batch_size
        self.order = order
        self._open: list[_Open] = []
        self._keys: dict[tuple, int] = {}
        cap = 64
        self._c = {c: np.zeros(cap, dtype=np.float64 if c == "oldest" else np.int64) for c in self._COLS}

    def _grow(self) -> None:
        for c, a in self._c.items():
            b = np.zeros(2 * len(a), dtype=a.dtype)
            b[:len(a)] = a
            self._c[c] = b

    def add(self, req: ProfiledRequest, now: float) -> None:
        L, G, P = req.input_tokens, req.predicted_tokens, req.planned_tokens
        u = _useful(L, G)
        kid = self._keys.setdefault(req.batch_key, len(self._keys))
        k = len(self._open)
        c = self._c
        if k:
            size = c["size"][:k]
            L_B = np.maximum(c["L"][:k], L)
            G_B = np.maximum(c["G"][:k], G)
            phi = G_B * L_B + G_B * (G_B + 1) // 2 - np.minimum(c["mu"][:k], u)
            sure, may = grow_bounds(self.ctx.memory.theta_tokens, self.ctx.elastic, size, c["L"][:k], c["P"][:k],
                                    c["pmin"][:k], c["peak"][:k], c["kpk"][:k], L, P, np.maximum, np.minimum)
            ok = (c["key"][:k] == kid) & may & (phi < self.threshold)
            if self.max_batch_size is not None:
                ok &= size < self.max_batch_size
            j = self._choose(np.flatnonzero(ok), phi, sure, L, P)
            if j is not None:
                ob = self._open[j]
                ob.batch.requests.append(req)
                ob.L, ob.G = int(L_B[j]), int(G_B[j])
                ob.min_useful = min(ob.min_useful, u)
                plan = ob.plan or self.ctx.plan()
                plan.add(L, P)
                ob.plan = plan
                c["L"][j], c["G"][j], c["mu"][j] = ob.L, ob.G, ob.min_useful
                c["size"][j] += 1
                c["oldest"][j] = min(c["oldest"][j], req.arrival)
                self._set_plan(j, plan)
                return
        if k == len(c["L"]):
            self._grow()
            c = self._c
        plan = self.ctx.plan()
        plan.add(L, P)
        self._open.append(_Open(Batch(id=new_id("b"), requests=[req], created=now), L, G, u, plan))
        c["L"][k], c["G"][k], c["mu"][k], c["size"][k], c["key"][k] = L, G, u, 1, kid
        c["oldest"][k] = req.arrival
        self._set_plan(k, plan)

    def _set_plan(self, j: int, plan: KVPlan) -> None:
        c = self._c
        c["P"][j], c["pmin"][j], c["peak"][j], c["kpk"][j] = plan.lens[-1], plan.lens[0], plan.peak, plan.k_peak

    def _choose(self, cand: np.ndarray, phi: np.ndarray, sure: np.ndarray, L: int, P: int) -> int | None:
        """The batch with the smallest φ (ties: opening order) among ``cand`` that the new request
        fits: ``sure`` ones need no test; the undecided ones before the first sure one in φ order
        get the exact test."""
        if not len(cand):
            return None
        order = cand[np.argsort(phi[cand], kind="stable")]
        surely = sure[order]
        first = int(np.argmax(surely)) if surely.any() else len(order)
        for j in order[:first]:
            plan = self._open[j].plan
            if plan is not None and plan.fits_with(L, P):
                return int(j)
        return int(order[first]) if first < len(order) else None

    def _remove(self, i: int) -> Batch:
        k = len(self._open)
        for a in self._c.values():
            a[i:k - 1] = a[i + 1:k]
        return self._open.pop(i).batch

    def _next_open(self, now: float) -> NextOpen | None:
        k = len(self._open)
        if not k:
            return None
        c = self._c
        oldest = c["oldest"][:k]
        if self.order == "hrrn":
            shapes = np.stack([c["size"][:k], c["L"][:k], c["G"][:k]], axis=1)
            ratio = response_ratios(shapes, oldest, self.ctx.estimator, now)
            i = hrrn_first(ratio, oldest)
            rank: Rank = (-float(ratio[i]), float(oldest[i]))
        else:
            i = int(np.argmin(oldest))
            rank = (float(oldest[i]),)
        return NextOpen(rank, lambda: self._remove(i))


class GLPPolicy(WMAPolicy):
    """GLP: WMA assembly with a fixed batch size cap (the VS size unless set), FCFS order."""

    def __init__(self, ctx: PolicyContext, threshold: float, batch_size: int | None = None) -> None:
        size = batch_size or ctx.memory.max_fixed_batch_size(ctx.max_input_tokens, ctx.max_tokens_limit)
        super().__init__(ctx, threshold, max_batch_size=size, order="oldest")


class ABPPolicy(WMAPolicy):
    """ABP: WMA assembly with only the memory cap Θ, FCFS order."""

    def __init__(self, ctx: PolicyContext, threshold: float) -> None:
        super().__init__(ctx, threshold, order="oldest")


class MagnusPolicy(WMAPolicy):
    """Magnus: ABP + batch-time estimator + HRRN pick."""

    def __init__(self, ctx: PolicyContext, threshold: float) -> None:
        super().__init__(ctx, threshold, order="hrrn")
