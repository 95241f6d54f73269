"""The one path every generation endpoint takes: validate, predict, enqueue, wait for the answer.

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
from cohort.logdb import finish_request, record_request
from cohort.settings import Settings
from cohort.tokenizer import build_prompt, prompt_token_counts
from cohort.types import InstanceInfo, ProfiledRequest, SamplingParams, new_id
from gateway.errors import APIError
from predictor.base import PredictItem

# Which HTTP status a failure reported by the batcher or worker becomes.
FAILURE_STATUS = {"out_of_memory": 507, "worker_lost": 503, "batch_failed": 500}


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


@dataclass
class Outcome:
    request: ProfiledRequest
    text: str
    generated_tokens: int
    batch_id: str
    batch_size: int
    timings: dict


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


async def wait_result(redis, request_id: str, timeout_s: float, slice_s: float = 2.0):
    """BLPOP the answer in short slices: a blocking read longer than the client's socket
    timeout (5 s by default in redis-py 8) would fail as a timeout on our side."""
    deadline = time.monotonic() + timeout_s
    while (left := deadline - time.monotonic()) > 0:
        got = await redis.blpop([bus.result_key(request_id)], timeout=min(slice_s, max(left, 0.01)))
        if got is not None:
            return got
    return None


async def submit(app_state, sub: Submission) -> Outcome:
    """Run one request through the system and return its outcome, or raise APIError."""
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
    depth = await redis.llen(bus.INCOMING) + await redis.hlen(bus.PENDING)
    if depth >= s.max_pending:
        raise APIError(429, f"the queue is full ({depth} requests waiting); retry later", code="queue_full")

    item = PredictItem(sub.instruction, sub.user_input, input_tokens, sub.task)
    predicted, version = await app_state.predictor.predict(item, sub.max_tokens)
    now = time.time()
    req = ProfiledRequest(id=new_id("req"), prompt=prompt, input_tokens=input_tokens,
                          predicted_tokens=int(predicted), max_tokens=sub.max_tokens, arrival=now,
                          model=s.model, sampling=sub.sampling, slo_s=sub.slo_s, instruction=sub.instruction,
                          user_input=sub.user_input, task=sub.task, emulated_tokens=sub.emulated_tokens,
                          predictor_version=version)
    await run_in_threadpool(record_request, app_state.db, {
        "id": req.id, "created": now, "model": s.model, "task": sub.task, "instruction": sub.instruction,
        "user_input": sub.user_input, "input_tokens": input_tokens, "max_tokens": sub.max_tokens,
        "predicted_tokens": req.predicted_tokens, "predictor_version": version,
        "emulated_tokens": sub.emulated_tokens, "slo_s": sub.slo_s, "status": "queued"})
    await redis.lpush(bus.INCOMING, bus.dumps(req.to_dict()))
    app_state.metrics.predicted_tokens.observe(req.predicted_tokens)

    got = await wait_result(redis, req.id, s.request_timeout_s)
    if got is None:
        await run_in_threadpool(finish_request, app_state.db, req.id, status="failed",
                                error="gateway timed out waiting for the result")
        raise APIError(504, f"no result within {s.request_timeout_s:.0f} s; the request may still run",
                       code="timeout")
    msg = json.loads(got[1])
    if not msg["ok"]:
        code = msg.get("code", "batch_failed")
        raise APIError(FAILURE_STATUS.get(code, 500), msg.get("error", "the request failed"), code=code)
    return Outcome(req, msg["text"], msg["generated_tokens"], msg["batch"]["id"], msg["batch"]["size"],
                   msg["timings"])
