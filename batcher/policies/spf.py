"""Shortest predicted first, with linear aging (``spf``): cohort's admission order for continuous execution.

Why: on a continuous engine at saturation the queue, not the batch, is where time goes, and
serving the shortest predicted answers first is what cuts mean latency and TTFT (SRPT's rule).
Pure SPF starves the longest answers (p99), so a request's rank improves by ``aging`` predicted
tokens per second of waiting:

    key(p) = G'(p) − aging · (now − arrival(p))

``now`` is common to every waiting request, so ranking by ``G'(p) + aging · arrival(p)`` is the
same order at every instant: one heap, no re-sorting. ``aging = 0`` is pure SPF, a very large
``aging`` is FCFS. A batch (an *admission group* under ``continuous``) is the head of that order
plus the next requests of the same batch key while the memory rule (``PolicyContext.plan``) still
fits: neighbours in the order have similar predicted lengths, so the group pads little even under
static execution. Measured choice of ``aging`` (5 tokens/s): docs/benchmarks.md, "Continuous
execution".
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

from batcher.policies.base import NextOpen, Policy, PolicyContext, Rank
from cohort.settings import Settings
from cohort.types import Batch, ProfiledRequest, new_id

# predicted tokens of rank gained per second of waiting: COHORT_SPF_AGING's default, one owner
DEFAULT_AGING: float = Settings.model_fields["spf_aging"].default


class SPFPolicy(Policy):
    """Groups in order of G'(p) + aging·arrival(p), each packed under Θ (module docstring)."""

    def __init__(self, ctx: PolicyContext, aging: float = DEFAULT_AGING) -> None:
        super().__init__(ctx)
        if aging < 0:
            raise ValueError("aging must be >= 0")
        self.aging = float(aging)
        self._heap: list[tuple[float, int, ProfiledRequest]] = []
        self._seq = count()

    def key(self, req: ProfiledRequest) -> float:
        """The rank of one request (lower goes first); see the module docstring."""
        return float(req.predicted_tokens) + self.aging * req.arrival

    def add(self, req: ProfiledRequest, now: float) -> None:
        heapq.heappush(self._heap, (self.key(req), next(self._seq), req))

    def _next_open(self, now: float) -> NextOpen | None:
        if not self._heap:
            return None
        return NextOpen((self._heap[0][0],), lambda: self._take(now))

    def _ranks(self, batches: Sequence[Batch], now: float) -> list[Rank]:
        return [(min(self.key(r) for r in b.requests),) for b in batches]

    def _take(self, now: float) -> Batch:
        """The head request and its successors in key order (same batch key) while they fit Θ."""
        heap = self._heap
        head = heapq.heappop(heap)[2]
        plan = self.ctx.plan()
        plan.add(head.input_tokens, head.planned_tokens)
        members, other = [head], []
        while heap:
            entry = heap[0]
            r = entry[2]
            if r.batch_key != head.batch_key:
                other.append(heapq.heappop(heap))
                continue
            if not plan.fits_with(r.input_tokens, r.planned_tokens):
                break
            heapq.heappop(heap)
            plan.add(r.input_tokens, r.planned_tokens)
            members.append(r)
        for e in other:
            heapq.heappush(heap, e)
        return Batch(id=new_id("b"), requests=members, created=now)
