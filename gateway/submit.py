"""The one path every generation endpoint takes in: validate, predict, enqueue (``admit``).
The answer is then read from the request's stream by gateway.relay.

Admission control happens before anything is written: a request that can never fit an instance,
a full queue (429) or no live instance (503) is refused up front, so an accepted request is
always one the system can answer — and it is answered, or failed explicitly, by the worker or
the batcher.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from batcher.memory import KVMemory
from cohort import bus
from cohort.logdb import record_request
from cohort.protocol import dumps
from cohort.settings import Settings
from cohort.tokenizer import build_prompt, load_tokenizer, prompt_token_counts
from cohort.types import InstanceInfo, ProfiledRequest, SamplingParams, new_id
from gateway.errors import APIError
from gateway.relay import Ticket
from predictor.base import PredictItem


@dataclass
class Submission:
    """A validated request, before it is profiled."""

    instruction: str
    user_input: str
    max_tokens: int
    slo_s: float | None = None
    sampling: SamplingParams = SamplingParams()
    emulated_tokens: int | None = None
    task: str | None = None


class PoolView:
    """The live instances of the pool, cached for a second (admission needs Θ and Δ)."""

    def __init__(self, settings: Settings, redis) -> None:
        self.settings, self.redis = settings, redis
        self._at, self._alive = 0.0, []

    async def alive(self) -> list[InstanceInfo]:
        now = time.monotonic()
        if now - self._at > 1.0:
            raw = await self.redis.hgetall(bus.INSTANCES)
            alive = []
            for name, js in raw.items():
                info = InstanceInfo.from_dict(json.loads(js))
                if info.pool == self.settings.pool and await self.redis.exists(bus.alive_key(name)):
                    alive.append(info)
            self._at, self._alive = now, alive
        return self._alive


def _vocab_size(model: str) -> int:
    return len(load_tokenizer(model))


async def admit(app_state, sub: Submission, endpoint: str, received: float | None = None) -> Ticket:
    """Validate, predict and enqueue one request, or raise APIError (nothing written then).
    ``received``: when the HTTP request arrived (``time.monotonic()``), for TTFT and latency."""
    received = time.monotonic() if received is None else received
    s: Settings = app_state.settings
    redis = app_state.redis
    if not (sub.instruction or sub.user_input):
        raise APIError(400, "the request has no text: give an instruction, an input or a prompt",
                       code="empty_prompt", param="input")
    if sub.max_tokens > s.max_tokens_limit:
        raise APIError(400, f"max_tokens {sub.max_tokens} exceeds the limit of {s.max_tokens_limit}",
                       code="invalid_value", param="max_tokens")
    if sub.emulated_tokens is not None:
        if not s.emulate_lengths:
            raise APIError(400, "emulated_tokens is a benchmark feature; the server runs with "
                           "COHORT_EMULATE_LENGTHS=false", code="emulation_disabled", param="emulated_tokens")
        if sub.emulated_tokens > sub.max_tokens:
            raise APIError(400, "emulated_tokens cannot exceed max_tokens", code="invalid_value",
                           param="emulated_tokens")
    if sub.sampling.logit_bias:
        vocab = await run_in_threadpool(_vocab_size, s.model)
        if (top := max(t for t, _ in sub.sampling.logit_bias)) >= vocab:
            raise APIError(400, f"logit_bias names token {top}; the model's vocabulary has {vocab} tokens",
                           code="invalid_value", param="logit_bias")
    prompt = build_prompt(sub.instruction, sub.user_input)
    (input_tokens,) = await run_in_threadpool(prompt_token_counts, [prompt], s.model)
    if input_tokens > s.max_input_tokens:
        raise APIError(400, f"the prompt has {input_tokens} tokens; the limit is {s.max_input_tokens}",
                       code="context_length_exceeded", param="input")
    alive = await app_state.pool.alive()
    if not alive:
        raise APIError(503, "no LLM instance is available yet; retry shortly", code="no_instance")
    memory = KVMemory.for_pool(alive)
    if not memory.fits(1, input_tokens, sub.max_tokens):
        raise APIError(400, f"prompt ({input_tokens} tokens) + max_tokens ({sub.max_tokens}) need "
                       f"{memory.mem(1, input_tokens, sub.max_tokens)} bytes of KV cache; an instance has "
                       f"{memory.theta_bytes}. Lower max_tokens or shorten the input.",
                       code="context_length_exceeded", param="max_tokens")
    keys = bus.pool_keys(s.pool)
    depth = await redis.llen(keys.incoming) + await redis.hlen(keys.pending)
    if depth >= s.max_pending:
        raise APIError(429, f"the queue is full ({depth} requests waiting); retry later", code="queue_full")

    item = PredictItem(sub.instruction, sub.user_input, input_tokens, sub.task)
    predicted, upper, version = await app_state.predictor.predict_bounds(item, sub.max_tokens)
    now = time.time()
    req = ProfiledRequest(id=new_id("req"), prompt=prompt, input_tokens=input_tokens,
                          predicted_tokens=int(predicted), predicted_upper=upper, max_tokens=sub.max_tokens, arrival=now,
                          model=s.model, sampling=sub.sampling, slo_s=sub.slo_s, instruction=sub.instruction,
                          user_input=sub.user_input, task=sub.task, emulated_tokens=sub.emulated_tokens,
                          predictor_version=version)
    await run_in_threadpool(record_request, app_state.db, {
        "id": req.id, "created": now, "model": s.model, "task": sub.task, "instruction": sub.instruction,
        "user_input": sub.user_input, "input_tokens": input_tokens, "max_tokens": sub.max_tokens,
        "predicted_tokens": req.predicted_tokens, "predictor_version": version,
        "emulated_tokens": sub.emulated_tokens, "slo_s": sub.slo_s, "status": "queued"})
    await redis.lpush(keys.incoming, dumps(req.to_dict()))
    app_state.metrics.predicted_tokens.observe(req.predicted_tokens)
    return Ticket(req, endpoint, received, deadline=time.monotonic() + s.request_timeout_s)
