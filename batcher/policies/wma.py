"""WMA-driven adaptive batch assembly (Magnus) and the policies built on it: GLP, ABP, Magnus.

On arrival of p, for every waiting batch B with p's key compute WMA(B ∪ {p}) with predicted
lengths, infinite when MEM(B ∪ {p}) > Θ (or β would pass a fixed cap); take the minimum φ; if
φ < Φ insert p there, else open a new batch.

WMA of member p simplifies to G_B·L_B + T(G_B) − (G_p·L_p + T(G_p)) with T(x) = x(x+1)/2,
so WMA(B) = G_B·L_B + T(G_B) − min_p (G_p·L_p + T(G_p)): each batch keeps three numbers and an
insertion test is O(1) per batch (tests check this against the literal definition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from batcher.policies.base import Policy, PolicyContext, pick_hrrn, pick_oldest
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

    def wma_with(self, L: int, G: int) -> tuple[int, int, int]:
        L_B, G_B = max(self.L, L), max(self.G, G)
        return _useful(L_B, G_B) - min(self.min_useful, _useful(L, G)), L_B, G_B


class WMAPolicy(Policy):
    """Adaptive assembly under Φ and Θ; ``max_batch_size`` caps β (GLP); ``order`` picks the batch."""

    name = "abp"

    def __init__(self, ctx: PolicyContext, threshold: float, max_batch_size: int | None = None,
                 order: str = "fcfs") -> None:
        super().__init__(ctx)
        if order not in ("fcfs", "hrrn"):
            raise ValueError(f"order must be fcfs or hrrn, not {order!r}")
        self.threshold = threshold
        self.max_batch_size = max_batch_size
        self.order = order
        self._open: list[_Open] = []

    def add(self, req: ProfiledRequest, now: float) -> None:
        L, G = req.input_tokens, req.predicted_tokens
        mem = self.ctx.memory
        best, best_phi = None, math.inf
        for ob in self._open:
            b = ob.batch
            if b.key != req.batch_key:
                continue
            if self.max_batch_size is not None and b.size >= self.max_batch_size:
                continue
            phi, L_B, G_B = ob.wma_with(L, G)
            if phi < best_phi and mem.fits(b.size + 1, L_B, G_B):
                best, best_phi = ob, phi
        if best is not None and best_phi < self.threshold:
            best.batch.requests.append(req)
            best.L, best.G = max(best.L, L), max(best.G, G)
            best.min_useful = min(best.min_useful, _useful(L, G))
        else:
            self._open.append(_Open(Batch(id=new_id("b"), requests=[req], created=now), L, G, _useful(L, G)))

    def pop(self, now: float) -> Batch | None:
        candidates = [ob.batch for ob in self._open] + self.closed
        if not candidates:
            return None
        if self.order == "hrrn":
            i = pick_hrrn(candidates, self.ctx.estimator, now)
        else:
            i = pick_oldest(candidates)
        n_open = len(self._open)
        if i < n_open:
            return self._open.pop(i).batch
        return self.closed.pop(i - n_open)

    def open_batches(self) -> list[Batch]:
        return [ob.batch for ob in self._open]


class GLPPolicy(WMAPolicy):
    """GLP: WMA assembly with a fixed batch size cap (the VS size unless set), FCFS order."""

    name = "glp"

    def __init__(self, ctx: PolicyContext, threshold: float, batch_size: int | None = None) -> None:
        size = batch_size or ctx.memory.max_fixed_batch_size(ctx.max_input_tokens, ctx.max_tokens_limit)
        super().__init__(ctx, threshold, max_batch_size=size, order="fcfs")


class ABPPolicy(WMAPolicy):
    """ABP: WMA assembly with only the memory cap Θ, FCFS order."""

    name = "abp"

    def __init__(self, ctx: PolicyContext, threshold: float) -> None:
        super().__init__(ctx, threshold, order="fcfs")


class MagnusPolicy(WMAPolicy):
    """Magnus: ABP + batch-time estimator + HRRN pick."""

    name = "magnus"

    def __init__(self, ctx: PolicyContext, threshold: float) -> None:
        super().__init__(ctx, threshold, order="hrrn")
