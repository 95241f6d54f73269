"""POST /v1/generate: the native endpoint (instruction, input, max_tokens, slo_seconds separately)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from gateway.relay import Relay
from gateway.schemas import GenerateRequest, GenerateResponse
from gateway.submit import Submission, admit
from gateway.validation import check_text_size

router = APIRouter()


@router.post("/v1/generate", response_model=GenerateResponse)
async def generate(body: GenerateRequest, request: Request) -> GenerateResponse:
    received = time.monotonic()
    st = request.app.state
    check_text_size(st.settings.max_text_chars, [("instruction", body.instruction), ("input", body.input)])
    ticket = await admit(st, Submission(
        instruction=body.instruction, user_input=body.input, max_tokens=body.max_tokens,
        slo_s=body.slo_seconds, sampling=body.sampling(), emulated_tokens=body.emulated_tokens,
        task=body.task, priority=body.priority), "generate", received)
    ans = await Relay(st, ticket, request.is_disconnected).collect()
    return GenerateResponse(id=ticket.request.id, text=ans.text, generated_tokens=ans.tokens,
                            predicted_tokens=ticket.request.predicted_tokens, finish_reason=ans.finish_reason,
                            batch={"id": ans.batch_id, "size": ans.batch_size}, timings=ans.timings)
