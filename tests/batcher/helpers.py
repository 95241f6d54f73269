"""Hand-built requests and a constant batch-time model for scheduler tests."""

from __future__ import annotations

import itertools

from batcher.memory import KVMemory
from batcher.policies import PolicyContext
from cohort.types import ProfiledRequest, SamplingParams

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
