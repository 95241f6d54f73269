"""Request and response bodies. Unknown fields are tolerated (clients send vendor extras).

Sampling fields are validated here, once, for every endpoint (``_Sampling``): a value out of
range is a 400 naming the field (gateway.errors turns pydantic's errors into OpenAI's body).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from cohort.types import SamplingParams

MAX_STOP = 4  # OpenAI's limit on stop sequences


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Sampling(_Lenient):
    """How a request samples: OpenAI's fields plus vLLM's ``top_k`` and ``repetition_penalty``.
    Every field reaches the worker, which applies it per row (cohort.types.SamplingParams)."""

    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    top_k: int = Field(default=0, ge=-1, description="0 or -1: off (vLLM's convention).")
    repetition_penalty: float = Field(default=1.0, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, description="token id → bias in [-100, 100]")
    stop: str | list[str] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.strip().isdigit():
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
        return v

    def sampling(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams.from_dict({
            "temperature": self.temperature, "top_p": self.top_p, "seed": self.seed,
            "top_k": max(0, self.top_k), "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "logit_bias": self.logit_bias or {}, "stop": stop})


class GenerateRequest(_Sampling):
    """Native endpoint: the instruction and the user input separately (the predictor uses both)."""

    instruction: str = Field(default="", max_length=200_000)
    input: str = Field(default="", max_length=200_000)
    max_tokens: int = Field(default=256, ge=1)
    slo_seconds: float | None = Field(default=None, gt=0)
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


class OpenAIRequest(_Sampling):
    """Fields both OpenAI endpoints share; ``ignore_eos`` and ``slo_seconds`` are cohort extras."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    slo_seconds: float | None = Field(default=None, gt=0)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(OpenAIRequest):
    prompt: str | list[str]


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = ""


class ChatCompletionRequest(OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
