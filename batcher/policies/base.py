"""The one interface every batching policy implements, and what policies may depend on.

A policy owns the waiting requests of one model pool. The service (or the simulator) calls
``add`` when a request arrives, ``pop`` only when an LLM instance is idle, ``requeue`` when a
dispatched batch comes back (OOM halves, a lost worker) and ``set_memory`` when Θ changes:
nothing else, so a policy has nothing else to implement. Policies never touch torch, Redis or
the clock: ``now`` is always passed in, so they run unchanged in the simulator.

Two kinds of batch wait. *Open* ones are the policy's own (still growing, or formed only at
dispatch); *closed* ones came back through ``requeue`` and run as they are. Which goes next
is decided here, once for every policy (``Policy.pop``): the policy offers its next open batch
(``_next_open``) with its rank under the policy's ``order``; the best re-queued batch under the
same order runs instead when it ranks at least as well (on a tie the re-queued batch goes
first: it was dispatched before and its requests are at least as old).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import numpy as np

from batcher.kv_judge import KVPlan
from batcher.memory import KVMemory
from cohort.types import Batch, ProfiledRequest

# How a policy ranks its batches, best first (``Policy.order``):
#   requeued  re-queued batches always first, in the order they came back (VS)
#   oldest    the batch whose oldest request arrived first (FCFS over batches)
#   deadline  the batch with the earliest deadline (EDF)
#   hrrn      the highest response ratio (T_w + T_p) / T_p; ties: the oldest (Magnus)
Order = Literal["requeued", "oldest", "deadline", "hrrn"]
Rank = tuple[float, ...]  # lower goes first


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
    # then size batches by their KV peak instead of β·(L(B)+G(B)) (``KVJudge.plan``).
    elastic: bool = False
    # Continuous execution over a prefix cache (the built-in engine's pages, or an upstream's own):
    # its page size, so a policy that groups by prefix counts a member's pages shared with the group
    # once (``batcher.prefix_groups``); 0: prompts share nothing.
    prefix_page_tokens: int = 0
    # Prompt tokens of a request that the instance it would go to already holds (prefix-aware routing:
    # the instance holding the most of its prefix); None: unknown. Read when a group is formed.
    cached_tokens: Callable[[ProfiledRequest], int] | None = None

    def plan(self) -> KVPlan:
        """An empty batch under this pool's Θ and execution mode: the one memory rule."""
        return self.memory.judge().plan(self.elastic)


def response_ratios(shapes: np.ndarray, oldest: np.ndarray, estimator: BatchTimeModel, now: float) -> np.ndarray:
    """HRRN's (T_w + T_p) / T_p per batch: T_w = wait of its oldest request, T_p = the estimated
    time of its (β, L(B), G'(B)) row in ``shapes``. The one HRRN formula: the WMA policies feed it
    their columns, the others ``batch_columns``."""
    tp = np.maximum(np.asarray(estimator.estimate_many(shapes), dtype=float), 1e-6)
    return (np.maximum(0.0, now - oldest) + tp) / tp


def batch_columns(batches: Sequence[Batch]) -> tuple[np.ndarray, np.ndarray]:
    """(shapes, oldest arrivals) of ``batches`` as ``response_ratios`` reads them."""
    shapes = np.array([(b.size, b.input_len, b.predicted_gen_len) for b in batches], dtype=np.int64).reshape(-1, 3)
    return shapes, np.array([b.oldest_arrival for b in batches], dtype=float)


def hrrn_first(ratios: np.ndarray, oldest: np.ndarray) -> int:
    """Index of the highest response ratio; ties: the oldest, then the first."""
    return int(np.lexsort((oldest, -ratios))[0])


@dataclass(frozen=True)
class NextOpen:
    """The open batch a policy would dispatch next, still in place: its rank under the policy's
    order, and ``take``, which removes and returns it. ``take`` may build the batch only when
    called: a re-queued batch that goes first costs no assembly."""

    rank: Rank
    take: Callable[[], Batch]


class Policy(ABC):
    """Base class: keeps the re-queued (closed) batches and decides between them and the open
    ones; subclasses assemble open batches and offer the next one (``_next_open``)."""

    order: Order = "oldest"  # a class default; WMA and S3 pick theirs per instance

    def __init__(self, ctx: PolicyContext) -> None:
        self.ctx = ctx
        self.closed: list[Batch] = []

    def set_memory(self, memory: KVMemory) -> None:
        """Θ or Δ changed (an instance joined or left the pool)."""
        self.ctx.memory = memory

    @abstractmethod
    def add(self, req: ProfiledRequest, now: float) -> None:
        """A request arrived."""

    def requeue(self, batch: Batch, now: float) -> None:
        """Put a whole batch back as it is (OOM half, lost worker): it no longer grows."""
        self.closed.append(batch)

    def pop(self, now: float) -> Batch | None:
        """An instance is idle: remove and return the batch to run next, or None if nothing waits."""
        nxt = self._next_open(now)
        if self.closed:
            ranks = self._ranks(self.closed, now)
            i = min(range(len(ranks)), key=ranks.__getitem__)
            if nxt is None or ranks[i] <= nxt.rank:
                return self.closed.pop(i)
        return nxt.take() if nxt is not None else None

    @abstractmethod
    def _next_open(self, now: float) -> NextOpen | None:
        """The open batch this policy would dispatch next under its ``order``, or None if none waits."""

    def handover_key(self, batch: Batch, now: float) -> float:
        """Where a dispatched ``batch`` stands among the pool's batches still waiting for an instance
        to take them (lower first): its rank where the order does not change with time (oldest,
        deadline, shortest predicted first), else ``now``, the hand-over order (HRRN's ratios move as
        batches wait; a re-queued batch keeps the order it came back in)."""
        if self.order in ("hrrn", "requeued"):
            return now
        return float(self._ranks([batch], now)[0][0])

    def _ranks(self, batches: Sequence[Batch], now: float) -> list[Rank]:
        """Rank of each batch under ``order``, as ``_next_open`` ranks its own."""
        if self.order == "requeued":
            return [() for _ in batches]
        if self.order == "oldest":
            return [(b.oldest_arrival,) for b in batches]
        if self.order == "deadline":
            return [(b.earliest_deadline,) for b in batches]
        shapes, oldest = batch_columns(batches)
        ratios = response_ratios(shapes, oldest, self.ctx.estimator, now)
        return [(-float(r), float(t)) for r, t in zip(ratios, oldest, strict=True)]
