"""Hand-built requests, a simple batch-time model, and inspection of a policy's queue for scheduler tests.

The inspection helpers read the policies' private state: the interface (``batcher.policies.base``)
has only what the service and the simulator call.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from batcher.memory import KVMemory
from batcher.policies import Policy, PolicyContext, S3Policy, SLOODBSPolicy, VanillaPolicy, WMAPolicy
from batcher.policies.base import BatchTimeModel, batch_columns, hrrn_first, response_ratios
from batcher.policies.priority import PriorityLevels
from cohort.types import Batch, ProfiledRequest, SamplingParams

_ids = itertools.count()


def req(L: int, G: int, arrival: float = 0.0, *, max_tokens: int = 512, slo: float | None = None,
        true: int | None = None, temperature: float = 0.0, model: str = "m") -> ProfiledRequest:
    i = next(_ids)
    return ProfiledRequest(id=f"r{i}", prompt=f"p{i}", input_tokens=L, predicted_tokens=G, max_tokens=max_tokens,
                           arrival=arrival, model=model, sampling=SamplingParams(temperature=temperature),
                           slo_s=slo, true_tokens=true)


class LinearTime:
    """T = 0.01 + 0.001·β·(L+G): enough structure for HRRN tests."""

    def estimate(self, size: int, input_len: int, gen_len: int) -> float:
        return 0.01 + 0.001 * size * (input_len + gen_len)

    def estimate_many(self, shapes):
        return [self.estimate(*s) for s in shapes]


def ctx(theta_tokens: int = 10_000, delta: int = 1, max_input: int = 100, max_tokens: int = 100) -> PolicyContext:
    """Δ = 1 byte so Θ reads directly in tokens."""
    return PolicyContext(memory=KVMemory(delta, theta_tokens * delta), estimator=LinearTime(),
                         max_input_tokens=max_input, max_tokens_limit=max_tokens)


def level(p: Policy, priority: int = 0) -> Policy:
    """The policy instance of one priority level (``make_policy`` wraps every policy in
    PriorityLevels); a bare policy is returned as it is."""
    if isinstance(p, PriorityLevels):
        return p._level(priority)
    return p


def open_batches(p: Policy) -> list[Batch]:
    """A WMA policy's batches still being assembled, in opening order."""
    return [ob.batch for ob in level(p)._open]


def queued(p: Policy) -> list[ProfiledRequest]:
    """Every request waiting in ``p``: its own queue, then the re-queued batches."""
    if isinstance(p, PriorityLevels):
        return [r for lv in sorted(p.levels) for r in queued(p.levels[lv])]
    if isinstance(p, WMAPolicy):
        own = [r for b in open_batches(p) for r in b.requests]
    elif isinstance(p, S3Policy):
        own = list(p._pending.values())
    elif isinstance(p, SLOODBSPolicy):
        own = [e[3] for e in p._pending]
    elif isinstance(p, VanillaPolicy):
        own = list(p.queue)
    else:
        raise TypeError(f"no inspection for {type(p).__name__}")
    return own + [r for b in p.closed for r in b.requests]


def pick_hrrn(batches: Sequence[Batch], estimator: BatchTimeModel, now: float) -> int:
    """Index of the batch HRRN dispatches first among ``batches``."""
    shapes, oldest = batch_columns(batches)
    return hrrn_first(response_ratios(shapes, oldest, estimator, now), oldest)


def pick_oldest(batches: Sequence[Batch]) -> int:
    """Index of the batch whose oldest request arrived first (ties: the first)."""
    return int(np.argmin([b.oldest_arrival for b in batches]))
