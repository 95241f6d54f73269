"""Vanilla scheduling (VS): first come, first served with a fixed batch size."""

from __future__ import annotations

from collections import deque

from batcher.policies.base import NextOpen, Policy, PolicyContext
from cohort.types import Batch, ProfiledRequest, new_id


class VanillaPolicy(Policy):
    """FCFS, fixed β. By default β is the largest size that cannot exceed Θ even when every
    member has the longest allowed input and max_tokens — what a server without length
    prediction must choose to never run out of memory.
    """

    order = "requeued"

    def __init__(self, ctx: PolicyContext, batch_size: int | None = None) -> None:
        super().__init__(ctx)
        self._fixed = batch_size
        self.queue: deque[ProfiledRequest] = deque()

    @property
    def batch_size(self) -> int:
        if self._fixed:
            return self._fixed
        return self.ctx.memory.max_fixed_batch_size(self.ctx.max_input_tokens, self.ctx.max_tokens_limit)

    def add(self, req: ProfiledRequest, now: float) -> None:
        self.queue.append(req)

    def _next_open(self, now: float) -> NextOpen | None:
        return NextOpen((), lambda: self._take(now)) if self.queue else None

    def _take(self, now: float) -> Batch:
        """The oldest request and the next β − 1 of its batch key, in arrival order."""
        head = self.queue.popleft()
        members, keep = [head], deque()
        while self.queue and len(members) < self.batch_size:
            r = self.queue.popleft()
            (members if r.batch_key == head.batch_key else keep).append(r)
        keep.extend(self.queue)
        self.queue = keep
        return Batch(id=new_id("b"), requests=members, created=now)
