"""Per-request priority (``ProfiledRequest.priority``; lower is served earlier, as in vLLM).

Every policy honours it the same way: one instance of the chosen policy per priority level, and
an idle instance takes the next batch of the most urgent level that has work. Priority is thus
strict across levels (a waiting priority-0 batch always goes before priority-1 work), and inside
a level the policy keeps its own assembly and order (WMA + HRRN, SLO-ODBS, …). Requests of
different priorities never share a batch. With every request at the default priority there is
one level and the policy behaves exactly as without this wrapper.
"""

from __future__ import annotations

from collections.abc import Callable

from batcher.memory import KVMemory
from batcher.policies.base import NextOpen, Policy, PolicyContext
from cohort.types import Batch, ProfiledRequest


class PriorityLevels(Policy):
    """The policy interface over one policy instance per priority level."""

    def __init__(self, ctx: PolicyContext, make: Callable[[], Policy]) -> None:
        super().__init__(ctx)
        self._make = make
        self.levels: dict[int, Policy] = {}

    def _level(self, priority: int) -> Policy:
        if priority not in self.levels:
            self.levels[priority] = self._make()
        return self.levels[priority]

    def add(self, req: ProfiledRequest, now: float) -> None:
        self._level(req.priority).add(req, now)

    def requeue(self, batch: Batch, now: float) -> None:
        self._level(min(r.priority for r in batch.requests)).requeue(batch, now)

    def set_memory(self, memory: KVMemory) -> None:
        super().set_memory(memory)
        for p in self.levels.values():
            p.set_memory(memory)

    def pop(self, now: float) -> Batch | None:
        for level in sorted(self.levels):
            batch = self.levels[level].pop(now)
            if batch is not None:
                return batch
        return None

    def handover_key(self, batch: Batch, now: float) -> float:
        """The key of the level's own policy (``Policy.handover_key``); the level itself goes first."""
        return self._level(min(r.priority for r in batch.requests)).handover_key(batch, now)

    def _next_open(self, now: float) -> NextOpen | None:  # pragma: no cover - ``pop`` is overridden
        raise NotImplementedError("PriorityLevels decides by level in pop()")
