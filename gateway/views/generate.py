"""POST /v1/generate: the native endpoint (instruction, input, max_tokens, slo_seconds separately)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from cohort.types import SamplingParams
from gateway.schemas import GenerateRequest, GenerateResponse
from gateway.submit import Submission, submit

router = APIRouter()


@router.post("/v1/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    st = request.app.state
    t0 = time.perf_counter()
    out = await submit(st, Submission(
        instruction=body.instruction, user_input=body.input, max_tokens=body.max_tokens,
        slo_s=body.slo_seconds, sampling=SamplingParams(body.temperature, body.top_p, body.seed),
        emulated_tokens=body.emulated_tokens, task=body.task))
    st.metrics.latency.labels("generate").observe(time.perf_counter() - t0)
    st.metrics.generated_tokens.inc(out.generated_tokens)
    return GenerateResponse(id=out.request.id, text=out.text, generated_tokens=out.generated_tokens,
                            predicted_tokens=out.request.predicted_tokens,
                            batch={"id": out.batch_id, "size": out.batch_size}, timings=out.timings)
