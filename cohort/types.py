"""The contracts that cross process boundaries: a profiled request and a batch.

Plain dataclasses with JSON round-trips (Celery and Redis carry JSON only, never pickle).
Nothing here imports torch or redis, so the batcher and the simulator can use them freely.
"""

from __future__ import annotations

import uuid
from dataclasses import asdict, dataclass, field
from typing import Any


def new_id(prefix: str) -> str:
    """A short unique id with a readable prefix (``req-…``, ``b-…``)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters. Only requests with identical parameters may share a batch."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass
class ProfiledRequest:
    """A request after the predictor has seen it: what the batcher needs, and what the worker runs.

    ``input_tokens`` is L(p); ``predicted_tokens`` is G'(p). ``true_tokens`` is the real
    generation length when it is known in advance (simulator, oracle policies); the live path
    never sets it. ``emulated_tokens`` makes the worker generate exactly that many tokens
    (benchmarks only, see SPEC "Emulated lengths").
    """

    id: str
    prompt: str
    input_tokens: int
    predicted_tokens: int
    max_tokens: int
    arrival: float
    model: str = "default"
    sampling: SamplingParams = field(default_factory=SamplingParams)
    slo_s: float | None = None
    instruction: str = ""
    user_input: str = ""
    task: str | None = None
    emulated_tokens: int | None = None
    true_tokens: int | None = None
    predictor_version: str | None = None

    @property
    def batch_key(self) -> tuple[Any, ...]:
        """Requests may share a batch only when this key is equal (same model, same sampling)."""
        s = self.sampling
        return (self.model, s.temperature, s.top_p, s.seed)

    @property
    def deadline(self) -> float:
        """Absolute deadline (arrival + SLO); +inf without an SLO."""
        return self.arrival + self.slo_s if self.slo_s is not None else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfiledRequest:
        d = dict(d)
        d["sampling"] = SamplingParams(**(d.get("sampling") or {}))
        return cls(**d)


@dataclass
class Batch:
    """A static batch. ``attempt`` counts re-queues after a lost worker; ``splits`` counts OOM halvings."""

    id: str
    requests: list[ProfiledRequest]
    created: float
    attempt: int = 0
    splits: int = 0

    @property
    def size(self) -> int:
        """β = |B|."""
        return len(self.requests)

    @property
    def input_len(self) -> int:
        """L(B) = max L(p)."""
        return max((r.input_tokens for r in self.requests), default=0)

    @property
    def predicted_gen_len(self) -> int:
        """G'(B) = max G'(p): the batch's generation length as planned."""
        return max((r.predicted_tokens for r in self.requests), default=0)

    @property
    def oldest_arrival(self) -> float:
        return min((r.arrival for r in self.requests), default=self.created)

    @property
    def earliest_deadline(self) -> float:
        return min((r.deadline for r in self.requests), default=float("inf"))

    @property
    def key(self) -> tuple[Any, ...] | None:
        return self.requests[0].batch_key if self.requests else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "requests": [r.to_dict() for r in self.requests],
            "created": self.created,
            "attempt": self.attempt,
            "splits": self.splits,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Batch:
        return cls(
            id=d["id"],
            requests=[ProfiledRequest.from_dict(r) for r in d["requests"]],
            created=d["created"],
            attempt=d.get("attempt", 0),
            splits=d.get("splits", 0),
        )


@dataclass
class InstanceInfo:
    """What a worker reports about its LLM instance: how much KV memory Θ it has and Δ per token."""

    name: str
    pool: str
    model: str
    theta_bytes: int
    delta_bytes: int
    device: str = "cpu"
    started: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InstanceInfo:
        return cls(**d)
