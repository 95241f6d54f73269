"""Request and response bodies. Unknown fields are tolerated (clients send vendor extras)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class GenerateRequest(_Lenient):
    """Native endpoint: the instruction and the user input separately (the predictor uses both)."""

    instruction: str = Field(default="", max_length=200_000)
    input: str = Field(default="", max_length=200_000)
    max_tokens: int = Field(default=256, ge=1)
    slo_seconds: float | None = Field(default=None, gt=0)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int | None = None
    emulated_tokens: int | None = Field(default=None, ge=0, description="Benchmarks: generate exactly this many.")
    task: str | None = Field(default=None, max_length=64)


class BatchInfo(BaseModel):
    id: str
    size: int


class Timings(BaseModel):
    queued_s: float
    run_s: float
    total_s: float


class GenerateResponse(BaseModel):
    id: str
    text: str
    generated_tokens: int
    predicted_tokens: int
    batch: BatchInfo
    timings: Timings


class _OpenAIRequest(_Lenient):
    """Fields both OpenAI endpoints share; ``ignore_eos`` and ``slo_seconds`` are cohort extras."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1)
    stream: bool = False
    seed: int | None = None
    ignore_eos: bool = False
    slo_seconds: float | None = Field(default=None, gt=0)


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[str]


class ChatMessage(_Lenient):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = ""


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
