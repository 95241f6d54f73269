"""OpenAI-compatible /v1/completions and /v1/chat/completions.

Static batching answers a request all at once, so ``stream: true`` is served as SSE with the
whole completion in one chunk followed by ``[DONE]``. ``ignore_eos`` (vLLM's benchmark flag)
asks for exactly max_tokens tokens and is honoured only when length emulation is on.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from cohort.types import SamplingParams
from gateway.errors import APIError
from gateway.schemas import ChatCompletionRequest, CompletionRequest
from gateway.submit import Outcome, Submission, submit

router = APIRouter()


def _finish_reason(out: Outcome) -> str:
    return "length" if out.generated_tokens >= out.request.max_tokens else "stop"


def _usage(out: Outcome) -> dict:
    p, c = out.request.input_tokens, out.generated_tokens
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _sse(obj: dict) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        yield f"data: {json.dumps(obj)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


async def _run(request: Request, sub: Submission, endpoint: str) -> Outcome:
    st = request.app.state
    t0 = time.perf_counter()
    out = await submit(st, sub)
    st.metrics.latency.labels(endpoint).observe(time.perf_counter() - t0)
    st.metrics.generated_tokens.inc(out.generated_tokens)
    return out


def _emulated(ignore_eos: bool, max_tokens: int, request: Request) -> int | None:
    return max_tokens if ignore_eos and request.app.state.settings.emulate_lengths else None


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    s = request.app.state.settings
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request is supported", code="invalid_value", param="prompt")
        prompt = prompt[0]
    max_tokens = body.max_tokens or s.default_max_tokens
    out = await _run(request, Submission(
        instruction="", user_input=prompt, max_tokens=max_tokens, slo_s=body.slo_seconds,
        sampling=SamplingParams(body.temperature, body.top_p, body.seed),
        emulated_tokens=_emulated(body.ignore_eos, max_tokens, request)), "completions")
    obj = {"id": f"cmpl-{out.request.id}", "object": "text_completion", "created": int(out.request.arrival),
           "model": body.model or s.model,
           "choices": [{"index": 0, "text": out.text, "logprobs": None, "finish_reason": _finish_reason(out)}],
           "usage": _usage(out)}
    return _sse(obj) if body.stream else obj


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    s = request.app.state.settings
    system = "\n".join(_content_text(m.content) for m in body.messages if m.role in ("system", "developer"))
    convo = "\n".join(f"{m.role}: {_content_text(m.content)}" for m in body.messages
                      if m.role not in ("system", "developer"))
    if not convo.strip():
        raise APIError(400, "messages need at least one non-system message", code="invalid_value",
                       param="messages")
    max_tokens = body.max_completion_tokens or body.max_tokens or s.default_max_tokens
    out = await _run(request, Submission(
        instruction=system, user_input=convo + "\nassistant:", max_tokens=max_tokens, slo_s=body.slo_seconds,
        sampling=SamplingParams(body.temperature, body.top_p, body.seed),
        emulated_tokens=_emulated(body.ignore_eos, max_tokens, request)), "chat")
    created, model, cid = int(out.request.arrival), body.model or s.model, f"chatcmpl-{out.request.id}"
    if body.stream:
        return _sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": out.text},
                                  "finish_reason": _finish_reason(out)}], "usage": _usage(out)})
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text},
                         "finish_reason": _finish_reason(out)}],
            "usage": _usage(out)}
