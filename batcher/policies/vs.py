"""Vanilla scheduling (VS): first come, first served with a fixed batch size."""

from __future__ import annotations

from collections import deque

from batcher.policies.base import Policy, PolicyContext
from cohort.types import Batch, ProfiledRequest, new_id


class VanillaPolicy(Policy):
    """FCFS, fixed β. By default β is the largest size that cannot exceed Θ even when every
    member has the longest allowed input and max_tokens — what a server without length
    prediction must choose to never run out of memory.
    """

    name = "vs"

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

    def pop(self, now: float) -> Batch | None:
        if self.closed:
            return self.closed.pop(0)
        if not self.queue:
            return None
        head = self.queue.popleft()
        members, keep = [head], deque()
        while self.queue and len(members) < self.batch_size:
            r = self.queue.popleft()
            (members if r.batch_key == head.batch_key else keep).append(r)
        keep.extend(self.queue)
        self.queue = keep
        return Batch(id=new_id("b"), requests=members, created=now)

    def open_batches(self) -> list[Batch]:
        """VS forms batches at dispatch; report the queue as the batches it would make."""
        out, reqs, k = [], list(self.queue), self.batch_size
        for i in range(0, len(reqs), k):
            out.append(Batch(id="pending", requests=reqs[i:i + k], created=reqs[i].arrival))
        return out
