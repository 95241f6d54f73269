"""The contracts that cross process boundaries: a profiled request and a batch.

Plain dataclasses with JSON round-trips (Celery and Redis carry JSON only, never pickle).
Nothing here imports torch or redis, so the batcher and the simulator can use them freely.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields, replace
from functools import cache
from typing import Any


@cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def field_values(obj: Any) -> dict[str, Any]:
    """A dataclass's fields as a dict, each value as it is. ``dataclasses.asdict`` deep-copies every
    list on the way; the messages built per token and per batch are JSON-dumped at once, so that
    copy was a measurable share of the worker's and the batcher's CPU (docs/notes/upstream.md).
    Callers convert nested dataclasses themselves."""
    return {name: getattr(obj, name) for name in _field_names(type(obj))}


def new_id(prefix: str) -> str:
    """A short unique id with a readable prefix (``req-…``, ``b-…``)."""
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. The worker applies them per row (transformers' logits
    processors and warpers, a generator per seeded row), so requests with different sampling
    parameters share a batch freely.

    ``logit_bias`` maps token id → bias (JSON keys arrive as strings and are converted back).
    ``stop`` strings end a row when its text contains one; the text is cut before the stop.
    ``logprobs``: None = none; k ≥ 0 = each generated token's log-probability and the k most
    likely alternatives, taken from the distribution the row samples from (after its processors).
    ``ignore_eos`` (vLLM's): the row never ends on EOS, only on ``max_tokens`` or a stop string.
    ``prompt_logprobs``: None = none; k ≥ 0 = each prompt token's log-probability and its k most
    likely alternatives (raw model scores; workers.prompt_logprobs).
    """

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    ignore_eos: bool = False
    prompt_logprobs: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def to_dict(self) -> dict[str, Any]:
        d = field_values(self)
        d["logit_bias"] = {str(k): v for k, v in self.logit_bias}
        d["stop"] = list(self.stop)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        d = dict(d or {})
        bias = d.get("logit_bias") or {}
        items = bias.items() if isinstance(bias, dict) else bias
        d["logit_bias"] = tuple(sorted((int(k), float(v)) for k, v in items))
        d["stop"] = tuple(d.get("stop") or ())
        return cls(**d)


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
    predicted_upper: int | None = None
    prompt_ids: list[int] | None = None
    generated_ids: list[int] = field(default_factory=list)
    preemptions: int = 0
    first_token_at: float | None = None
    priority: int = 0  # lower is served earlier (vLLM's convention); see batcher.policies.priority
    owner: str | None = None  # the gateway that streams it from its upstream engine itself (None: relayed)

    # A *continuation* is a request that was preempted mid-generation (elastic execution): its
    # ``prompt_ids`` are the original prompt's token ids and ``generated_ids`` what it produced
    # (and streamed) so far; the worker resumes from ``prompt_ids + generated_ids`` without
    # re-tokenizing text. The planning fields then describe what is *left*: ``input_tokens`` =
    # len(prompt_ids) + len(generated_ids) (what the batch must prefill), ``predicted_tokens``,
    # ``predicted_upper``, ``max_tokens``, ``emulated_tokens`` and ``true_tokens`` = the remaining
    # tokens. ``first_token_at`` keeps the time of the answer's first token across preemptions.

    @property
    def batch_key(self) -> tuple[Any, ...]:
        """Requests may share a batch only when this key is equal: the same model. Sampling is
        applied per row by the worker, so it does not split batches."""
        return (self.model,)

    @property
    def planned_tokens(self) -> int:
        """The length memory planning uses: the upper quantile when the predictor gave one
        (under-prediction is what overflows memory), else the point prediction."""
        return self.predicted_upper if self.predicted_upper is not None else self.predicted_tokens

    @property
    def run_plan_tokens(self) -> int:
        """What planning reserves for this run of it: its planned length within ``max_tokens``, at
        least one token (every running-set plan: the worker's rows, an upstream's, placement)."""
        return max(1, min(self.planned_tokens, self.max_tokens))

    @property
    def done_tokens(self) -> int:
        """Tokens already generated for this request before this (continuation) run."""
        return len(self.generated_ids)

    def continuation(self, new_ids: list[int], first_token_at: float | None) -> ProfiledRequest:
        """This request preempted after generating ``new_ids`` in the current run: the same id
        and stream, resumed later from prompt + everything generated so far."""
        k = len(new_ids)

        def left(x: int | None) -> int | None:
            return None if x is None else max(0, x - k)

        return replace(
            self, generated_ids=[*self.generated_ids, *new_ids],
            input_tokens=(self.input_tokens if self.prompt_ids is None
                          else len(self.prompt_ids) + len(self.generated_ids)) + k,
            predicted_tokens=max(1, self.predicted_tokens - k), predicted_upper=None if self.predicted_upper is None else max(1, self.predicted_upper - k),
            max_tokens=self.max_tokens - k, emulated_tokens=left(self.emulated_tokens),
            true_tokens=left(self.true_tokens), preemptions=self.preemptions + 1,
            first_token_at=self.first_token_at or first_token_at)

    @property
    def deadline(self) -> float:
        """Absolute deadline (arrival + SLO); +inf without an SLO."""
        return self.arrival + self.slo_s if self.slo_s is not None else float("inf")

    def to_dict(self) -> dict[str, Any]:
        d = field_values(self)
        d["sampling"] = self.sampling.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ProfiledRequest:
        d = dict(d)
        d["sampling"] = SamplingParams.from_dict(d.get("sampling"))
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
    served_model_name: str = ""   # the OpenAI ``model`` id clients use for this pool ("": the model path)
    max_model_len: int = 0        # prompt + generated tokens the instance's model takes (0: not known)
    page_tokens: int = 0          # tokens per KV page of its engine (0: COHORT_CONTINUOUS__PAGE_TOKENS)

    @property
    def upstream(self) -> bool:
        """An OpenAI-compatible server cohort feeds (``workers.upstream_start``), not a built-in engine."""
        return self.device.startswith("upstream:")

    def to_dict(self) -> dict[str, Any]:
        return field_values(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> InstanceInfo:
        return cls(**d)
