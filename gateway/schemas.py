"""Request and response bodies. Unknown fields are tolerated (clients send vendor extras).

Sampling fields are validated here, once, for every endpoint (``_Sampling``): a value out of
range is a 400 naming the field (gateway.errors turns pydantic's errors into OpenAI's body).
Every range is one the sampler can take: no NaN or infinity anywhere, seeds in 0..2⁶³−1,
a repetition penalty whose inverse stays finite, temperatures below ``GREEDY_BELOW`` sampled
greedily (dividing logits by 1e-40 gives infinities). Every string must be valid Unicode
(gateway.validation.check_unicode, run on the raw body before the fields are read).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cohort.sampling_defaults import OPENAI_DEFAULTS
from cohort.types import SamplingParams
from gateway.validation import check_unicode

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 1000
MAX_SEED = 2**63 - 1  # the worker seeds a torch generator: a signed 64-bit integer
GREEDY_BELOW = 1e-5  # temperatures below this are greedy (vLLM's convention too)
PRIORITY_RANGE = 2**31  # priority lies in [-2³¹, 2³¹)
MAX_SLO_S = 86_400.0


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class _Sampling(_Lenient):
    """How a request samples: OpenAI's fields plus vLLM's ``top_k`` and ``repetition_penalty``.
    Every field reaches the worker, which applies it per row (cohort.types.SamplingParams)."""

    temperature: float = Field(default=0.0, ge=0.0, le=2.0,
                               description=f"0 (and anything below {GREEDY_BELOW:g}): greedy decoding.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    top_k: int = Field(default=0, ge=-1, le=2**31 - 1, description="0 or -1: off (vLLM's convention).")
    repetition_penalty: float = Field(default=1.0, ge=0.01, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, description="token id → bias in [-100, 100]")
    stop: str | list[str] | None = None
    priority: int = Field(default=0, ge=-PRIORITY_RANGE, lt=PRIORITY_RANGE,
                          description="Lower is served earlier (vLLM's convention). Levels are strict: waiting "
                          "work of a lower number always goes first; under overload the highest numbers are "
                          "refused or shed first (429).")

    @model_validator(mode="before")
    @classmethod
    def _valid_text(cls, data: Any) -> Any:
        check_unicode(data)
        return data

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not (k.strip().isascii() and k.strip().isdigit()):
                raise ValueError(f"keys are token ids (non-negative integers as strings), got {k!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"bias of token {k} is {b}; biases lie in [-100, 100]")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("stop sequences cannot be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop sequences have at most {MAX_STOP_CHARS} characters")
        return v

    def sampling(self, defaults: Mapping[str, float] | None = None) -> SamplingParams:
        """The request's sampling; a field it left out (None) takes ``defaults`` (the served
        model's: cohort.sampling_defaults), else the neutral value."""
        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else (defaults or {}).get(name, neutral)

        temperature, top_k = pick("temperature", 0.0), int(pick("top_k", 0))
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams.from_dict({
            "temperature": temperature if temperature >= GREEDY_BELOW else 0.0,
            "top_p": pick("top_p", 1.0), "seed": self.seed,
            "top_k": max(0, top_k), "repetition_penalty": pick("repetition_penalty", 1.0),
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias or {}, "stop": stop})


class GenerateRequest(_Sampling):
    """Native endpoint: the instruction and the user input separately (the predictor uses both)."""

    instruction: str = ""
    input: str = ""
    max_tokens: int = Field(default=256, ge=1)
    slo_seconds: float | None = Field(default=None, gt=0, le=MAX_SLO_S)
    emulated_tokens: int | None = Field(default=None, ge=0, description="Benchmarks: generate exactly this many.")
    task: str | None = Field(default=None, max_length=64)


class BatchInfo(BaseModel):
    id: str
    size: int


class Timings(BaseModel):
    """Seconds from the request's arrival (as the worker measured them)."""

    queued_s: float
    first_token_s: float | None = None  # None: the answer has no token
    run_s: float
    total_s: float


class GenerateResponse(BaseModel):
    id: str
    text: str
    generated_tokens: int
    predicted_tokens: int
    finish_reason: str
    batch: BatchInfo
    timings: Timings


class StreamOptions(_Lenient):
    include_usage: bool = False


MAX_N = 16          # choices per prompt (n)
MAX_PROMPT_LOGPROBS = 20
MAX_USER_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512
MAX_CHOICES = 64    # choices per request (prompts × n)


def _neutral(value: Any, *allowed: Any) -> bool:
    return value is None or value in allowed


# OpenAI fields cohort does not implement, and the values that ask for nothing (so a client that
# sends its defaults is not refused). Any other value is a 400 naming the field: never ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": ([],), "tool_choice": ("none",), "functions": ([],), "function_call": ("none",),
    "parallel_tool_calls": (False,), "response_format": ({"type": "text"},), "audio": (), "modalities": (["text"],),
    "prediction": (), "web_search_options": (), "reasoning_effort": (), "store": (False,),
    "service_tier": ("auto", "default"), "suffix": ("",), "guided_json": (), "guided_regex": (),
    "guided_choice": (), "guided_grammar": (), "min_tokens": (0,), "use_beam_search": (False,),
}
# Fields accepted without any effect (identifiers for the caller's own bookkeeping).
ACCEPTED_UNUSED = ("user", "metadata")


class OpenAIRequest(_Sampling):
    """Fields both OpenAI endpoints share; ``ignore_eos`` (vLLM's) and ``slo_seconds`` are extras.
    Unknown fields are kept aside (``model_extra``) so ``refused()`` can name an unsupported one."""

    model_config = ConfigDict(extra="allow")

    # Left out: the served model's defaults (OpenAI's temperature 1 and top_p 1, or its
    # generation_config.json's: cohort.sampling_defaults), not the native endpoint's greedy.
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description=(
        f"Default: the served model's (1.0 unless its generation config says otherwise; /v1/models shows "
        f"it). Below {GREEDY_BELOW:g}: greedy decoding."))
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=2**31 - 1, description="0 or -1: off (vLLM's convention).")
    repetition_penalty: float | None = Field(default=None, ge=0.01, le=10.0)
    model: str | None = Field(default=None, max_length=512)
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    emulated_tokens: int | None = Field(default=None, ge=0, description=(
        "Benchmarks (COHORT_EMULATE_LENGTHS): generate exactly this many while max_tokens stays the "
        "client's bound, so the length is not given away to the predictor as ignore_eos + max_tokens would."))
    slo_seconds: float | None = Field(default=None, gt=0, le=MAX_SLO_S)
    user: str | None = Field(default=None, max_length=MAX_USER_CHARS)
    metadata: dict[str, str] | None = Field(default=None, description=(
        f"Caller bookkeeping, no effect: at most {MAX_METADATA_PAIRS} pairs, keys ≤ {MAX_METADATA_KEY} and "
        f"values ≤ {MAX_METADATA_VALUE} characters (OpenAI's limits)."))

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None:
            if len(v) > MAX_METADATA_PAIRS:
                raise ValueError(f"at most {MAX_METADATA_PAIRS} metadata pairs, got {len(v)}")
            if any(len(k) > MAX_METADATA_KEY or len(x) > MAX_METADATA_VALUE for k, x in v.items()):
                raise ValueError(f"metadata keys have at most {MAX_METADATA_KEY} characters and values at most "
                                 f"{MAX_METADATA_VALUE}")
        return v

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def refused(self) -> str | None:
        """The first field this request sets that cohort does not implement, or None."""
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and not _neutral(value, *UNSUPPORTED[name]):
                return name
        return None

    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_PROMPT_LOGPROBS, description=(
        "vLLM's: each prompt token's log-probability and this many alternatives (choices[i].prompt_logprobs)"))

    def logprobs_k(self) -> int | None:
        """How many alternatives per token the worker reports (None: no logprobs)."""
        return None

    def prompt_logprobs_k(self) -> int | None:
        """How many alternatives per prompt token the worker reports (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def sampling(self, defaults: Mapping[str, float] | None = None) -> SamplingParams:
        """Left-out fields take ``defaults`` (the served model's), OpenAI's when none are given."""
        return replace(super().sampling(OPENAI_DEFAULTS if defaults is None else defaults),
                       logprobs=self.logprobs_k(), prompt_logprobs=self.prompt_logprobs_k(),
                       ignore_eos=self.ignore_eos)


TokenPrompt = list[int]


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str] | TokenPrompt | list[TokenPrompt] = Field(
        description="a string, a list of strings, a list of token ids or a list of token-id lists")
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    max_tokens: int | None = Field(default=None, ge=0, description="0 (with echo): score the prompt only")

    @property
    def scores_prompt(self) -> bool:
        """echo with logprobs: the prompt's tokens are scored too (OpenAI's legacy shape)."""
        return self.echo and self.logprobs is not None

    def prompt_logprobs_k(self) -> int | None:
        if self.scores_prompt:
            return max(self.logprobs or 0, self.prompt_logprobs or 0)
        return self.prompt_logprobs

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request, text or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def logprobs_k(self) -> int | None:
        return self.logprobs


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = ""
    name: str | None = Field(default=None, max_length=256)
    tool_calls: list[Any] | None = None


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
