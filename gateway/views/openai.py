"""OpenAI-compatible /v1/completions and /v1/chat/completions.

``stream: true`` relays tokens as they are generated (gateway.sse); without it the answer comes
whole when the request's row finishes — not when its batch does. ``ignore_eos`` (vLLM's
benchmark flag) asks for exactly max_tokens tokens and is honoured only when length emulation
is on. Admission errors are plain HTTP errors even for streams: nothing is sent before admission.
"""

from __future__ import annotations

import time

from fastapi import APIRouter, Request

from gateway.errors import APIError
from gateway.relay import Answer, Relay, Ticket
from gateway.schemas import ChatCompletionRequest, CompletionRequest, OpenAIRequest
from gateway.sse import Chunks, sse_response, usage
from gateway.submit import Submission, admit

router = APIRouter()


def _usage(ticket: Ticket, ans: Answer) -> dict:
    return usage(ticket.request.input_tokens, ans.tokens)


def _content_text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content if isinstance(part, dict))


def _submission(body: OpenAIRequest, request: Request, instruction: str, user_input: str,
                max_tokens: int) -> Submission:
    emulated = max_tokens if body.ignore_eos and request.app.state.settings.emulate_lengths else None
    return Submission(instruction=instruction, user_input=user_input, max_tokens=max_tokens,
                      slo_s=body.slo_seconds, sampling=body.sampling(), emulated_tokens=emulated)


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    received = time.monotonic()
    st = request.app.state
    prompt = body.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise APIError(400, "one prompt per request is supported", code="invalid_value", param="prompt")
        prompt = prompt[0]
    max_tokens = body.max_tokens or st.settings.default_max_tokens
    ticket = await admit(st, _submission(body, request, "", prompt, max_tokens), "completions", received)
    relay = Relay(st, ticket, request.is_disconnected)
    cid, created, model = f"cmpl-{ticket.request.id}", int(ticket.request.arrival), body.model or st.settings.model
    if body.stream:
        return sse_response(relay, Chunks("completions", cid, created, model, body.include_usage))
    ans = await relay.collect()
    return {"id": cid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": ans.text, "logprobs": None, "finish_reason": ans.finish_reason}],
            "usage": _usage(ticket, ans)}


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    received = time.monotonic()
    st = request.app.state
    system = "\n".join(_content_text(m.content) for m in body.messages if m.role in ("system", "developer"))
    convo = "\n".join(f"{m.role}: {_content_text(m.content)}" for m in body.messages
                      if m.role not in ("system", "developer"))
    if not convo.strip():
        raise APIError(400, "messages need at least one non-system message", code="invalid_value",
                       param="messages")
    max_tokens = body.max_completion_tokens or body.max_tokens or st.settings.default_max_tokens
    ticket = await admit(st, _submission(body, request, system, convo + "\nassistant:", max_tokens), "chat",
                         received)
    relay = Relay(st, ticket, request.is_disconnected)
    cid, created, model = f"chatcmpl-{ticket.request.id}", int(ticket.request.arrival), body.model or st.settings.model
    if body.stream:
        return sse_response(relay, Chunks("chat", cid, created, model, body.include_usage))
    ans = await relay.collect()
    return {"id": cid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": ans.text},
                         "logprobs": None, "finish_reason": ans.finish_reason}],
            "usage": _usage(ticket, ans)}
