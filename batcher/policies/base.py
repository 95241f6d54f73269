"""The one interface every batching policy implements, and what policies may depend on.

A policy owns the waiting requests of one model pool. The service (or the simulator) calls
``add`` when a request arrives, ``pop`` only when an LLM instance is idle, and ``requeue``
when a dispatched batch comes back (OOM halves, a lost worker). Policies never touch torch,
Redis or the clock: ``now`` is always passed in, so they run unchanged in the simulator.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from batcher.memory import KVMemory, KVPlan
from cohort.types import Batch, ProfiledRequest


class BatchTimeModel(Protocol):
    """Estimated wall time of a batch from (β, L(B), G(B)); KNN or analytic (predictor.estimator)."""

    def estimate(self, size: int, input_len: int, gen_len: int) -> float: ...

    def estimate_many(self, shapes: Sequence[tuple[int, int, int]]) -> Sequence[float]: ...


@dataclass
class PolicyContext:
    """What a policy may know about the pool it schedules for."""

    memory: KVMemory
    estimator: BatchTimeModel
    max_input_tokens: int = 2048
    max_tokens_limit: int = 2048
    # True under elastic execution (finished rows leave their batch): predicted-length policies
    # then size batches by their KV peak instead of β·(L(B)+G(B)) (``KVMemory.plan``).
    elastic: bool = False

    def plan(self) -> KVPlan:
        """An empty batch under this pool's Θ and execution mode: the one memory rule."""
        return self.memory.plan(self.elastic)


class Policy(ABC):
    """Base class: keeps re-queued (closed) batches; subclasses decide assembly and order."""

    name: ClassVar[str] = "base"

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.closed: list[Batch] = []

    def set_memory(self, memory: KVMemory) -> None:
        """Θ or Δ changed (an instance joined or left the pool)."""
        self.ctx.memory = memory

    @abstractmethod
    def add(self, req: ProfiledRequest, now: float) -> None:
        """A request arrived."""

    @abstractmethod
    def pop(self, now: float) -> Batch | None:
        """An instance is idle: remove and return the batch to run next, or None if nothing waits."""

    @abstractmethod
    def open_batches(self) -> list[Batch]:
        """Batches still being assembled (may grow)."""

    def requeue(self, batch: Batch, now: float) -> None:
        """Put a whole batch back as it is (OOM half, lost worker): it no longer grows."""
        self.closed.append(batch)

    def waiting(self) -> list[Batch]:
        """Every batch waiting, open and closed."""
        return self.open_batches() + list(self.closed)

    def pending_requests(self) -> int:
        return sum(b.size for b in self.waiting())

    def __len__(self) -> int:
        return self.pending_requests()


def response_ratios(batches: Sequence[Batch], estimator: BatchTimeModel, now: float) -> list[float]:
    """HRRN: (T_w + T_p) / T_p, T_w = wait of the oldest request, T_p = estimated batch time."""
    if not batches:
        return []
    shapes = [(b.size, b.input_len, b.predicted_gen_len) for b in batches]
    times = estimator.estimate_many(shapes)
    out = []
    for b, tp in zip(batches, times, strict=True):
        tp = max(float(tp), 1e-6)
        out.append((max(0.0, now - b.oldest_arrival) + tp) / tp)
    return out


def pick_hrrn(batches: Sequence[Batch], estimator: BatchTimeModel, now: float) -> int:
    """Index of the batch with the highest response ratio (ties: the oldest)."""
    ratios = response_ratios(batches, estimator, now)
    return max(range(len(batches)), key=lambda i: (ratios[i], -batches[i].oldest_arrival))


def pick_oldest(batches: Sequence[Batch]) -> int:
    """Index of the batch whose oldest request arrived first (FCFS over batches)."""
    return min(range(len(batches)), key=lambda i: batches[i].oldest_arrival)
