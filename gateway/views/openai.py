"""OpenAI-compatible /v1/completions and /v1/chat/completions.

``model`` picks the pool (gateway.pools; omitted: the default pool, unknown: 404). Every field
is honoured or refused with a 400 naming it (schemas.UNSUPPORTED; README's parameter table):

- ``n`` copies of a prompt, and each prompt of a prompt list, are requests of their own, admitted
  together (so they can share a batch) and answered as choices ``index = prompt·n + copy``; a
  seeded request's copy j samples with ``seed + j`` (equal seeds would give equal copies);
- token-id prompts go to the worker as they are (L(p) = their count);
- chat messages are rendered with the pool tokenizer's chat template when it has one, else with
  the built-in template (cohort.tokenizer.builtin_chat_prompt); the predictor reads the system
  text as the instruction and the conversation as the input either way;
- ``logprobs``/``top_logprobs`` come from the worker (gateway.logprobs); ``echo`` prepends the
  prompt, and with ``logprobs`` its tokens are scored too (from the prefill: workers.prompt_logprobs),
  as is vLLM's ``prompt_logprobs``; ``max_tokens: 0`` with echo scores the prompt only.

``stream: true`` relays tokens as they are generated (gateway.sse); without it the answer comes
whole when the request's rows finish — not when their batch does. ``ignore_eos`` (vLLM's
sampling flag) makes the row ignore EOS: it ends at max_tokens or a stop string. Sampling fields
left out take the served model's defaults (cohort.sampling_defaults). Admission errors are plain HTTP errors even for streams: nothing is sent before admission.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool

from cohort.sampling_defaults import sampling_defaults
from cohort.tokenizer import builtin_chat_prompt, chat_prompt_ids, decode, has_chat_template, split_chat
from gateway import logprobs as lp
from gateway.errors import APIError
from gateway.pools import ServedModel
from gateway.relay import Relay, RequestMetrics, Ticket
from gateway.schemas import (
    MAX_CHOICES,
    MAX_SEED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    OpenAIRequest,
)
from gateway.sse import Chunks, cached_tokens, collect_all, sse_response, usage
from gateway.submit import Submission, admit_many, check_token_ids
from gateway.validation import check_text_size

router = APIRouter()

TEXT_PARTS = ("text", "input_text")


def _refuse_unsupported(body: OpenAIRequest) -> None:
    if field := body.refused():
        raise APIError(400, f"{field} is not supported by cohort (see the parameter table in the README); "
                       "leave it out", code="unsupported_parameter", param=field)


def _content_text(i: int, m: ChatMessage) -> str:
    if m.content is None:
        return ""
    if isinstance(m.content, str):
        return m.content
    parts = []
    for part in m.content:
        if part.get("type", "text") not in TEXT_PARTS:
            raise APIError(400, f"content parts of type {part.get('type')!r} are not supported: cohort serves "
                           "text only", code="unsupported_parameter", param=f"messages.{i}.content")
        parts.append(str(part.get("text", "")))
    return "".join(parts)


def _refuse_streamed_prompt_scores(body: OpenAIRequest) -> None:
    """The prompt's logprobs come whole, not streamed: a stream that asks for them is refused."""
    if body.stream and body.prompt_logprobs_k() is not None:
        raise APIError(400, "the prompt's logprobs (echo with logprobs, prompt_logprobs) are not streamed; "
                       "send the request without stream", code="unsupported_parameter", param="stream")


def _prompt_logprobs(body: OpenAIRequest, served: ServedModel, answer) -> dict:
    """vLLM's ``prompt_logprobs`` field of a choice, when the request asked for it."""
    if body.prompt_logprobs is None:
        return {}
    value = lp.vllm_prompt_logprobs(served.path, *answer.prompt) if answer.prompt is not None else None
    return {"prompt_logprobs": value}


def _copies(body: OpenAIRequest, base: Submission) -> list[Submission]:
    """``n`` requests from one prompt; a seeded copy j samples with seed + j (wrapping within the
    seed range)."""
    seed = base.sampling.seed
    return [base if j == 0 or seed is None
            else replace(base, sampling=replace(base.sampling, seed=(seed + j) % (MAX_SEED + 1)))
            for j in range(body.n)]


def _submission(body: OpenAIRequest, request: Request, served: ServedModel, max_tokens: int, **kw) -> Submission:
    emulated = body.emulated_tokens  # validated with the other limits (gateway.submit)
    if emulated is None and body.ignore_eos and request.app.state.settings.emulate_lengths:
        emulated = max_tokens
    sampling = body.sampling(sampling_defaults(served.path).values)
    return Submission(max_tokens=max_tokens, slo_s=body.slo_seconds, sampling=sampling,
                      emulated_tokens=emulated, priority=body.priority, **kw)


async def _admit(request: Request, served: ServedModel, subs: list[Submission], endpoint: str,
                 received: float) -> tuple[list[Ticket], list[Relay]]:
    st = request.app.state
    tickets = await admit_many(st, subs, endpoint, received, served)
    group = RequestMetrics(len(tickets))  # the per-request series see the choices as one request
    return tickets, [Relay(st, t, request.is_disconnected, group) for t in tickets]


def _prompt_tokens(tickets: list[Ticket], n: int) -> int:
    """Usage counts each prompt once, however many copies (n) were generated from it."""
    return sum(t.request.input_tokens for t in tickets[::n])


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    received = time.monotonic()
    st = request.app.state
    _refuse_unsupported(body)
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of other than n is not supported: cohort returns every sample it generates",
                       code="unsupported_parameter", param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 generates nothing: it is only useful with echo (score the prompt)",
                       code="invalid_value", param="max_tokens")
    _refuse_streamed_prompt_scores(body)
    prompts = body.prompts()
    if not prompts or any(len(p) == 0 for p in prompts):
        raise APIError(400, "prompt is empty", code="empty_prompt", param="prompt")
    check_text_size(st.settings.max_text_chars, [("prompt", p) for p in prompts])
    if len(prompts) * body.n > MAX_CHOICES:
        raise APIError(400, f"{len(prompts)} prompts × n={body.n} exceeds {MAX_CHOICES} choices per request",
                       code="invalid_value", param="n")
    served = await st.pool.resolve(body.model)
    max_tokens = body.max_tokens if body.max_tokens is not None else st.settings.default_max_tokens
    subs, texts = [], []
    for p in prompts:
        if isinstance(p, str):
            base = _submission(body, request, served, max_tokens, instruction="", user_input=p, param="prompt")
            texts.append(p)
        else:
            await check_token_ids(served, p, "prompt")
            text = await run_in_threadpool(decode, p, served.path)
            base = _submission(body, request, served, max_tokens, instruction="", user_input=text, prompt=text,
                               prompt_ids=list(p), param="prompt")
            texts.append(text)
        subs += _copies(body, base)
    tickets, relays = await _admit(request, served, subs, "completions", received)
    cid, created = f"cmpl-{tickets[0].request.id}", int(tickets[0].request.arrival)
    prefixes = [texts[k // body.n] for k in range(len(subs))] if body.echo else [""] * len(subs)
    # Streamed, the echoed prompt is the first chunk and counts the offsets on; whole, it is skipped.
    formatters = [lp.CompletionLogprobs(served.path, offset=0 if body.stream else len(prefix)) for prefix in prefixes]

    def render(index: int, pairs: list, text: str) -> dict | None:
        return formatters[index](pairs, text)

    if body.stream:
        chunks = Chunks("completions", cid, created, served.id, body.include_usage,
                        render if body.logprobs is not None else None)
        return sse_response(relays, chunks, prefixes, _prompt_tokens(tickets, body.n), body.n)
    answers = await collect_all(relays)
    choices = []
    for k, a in enumerate(answers):
        logprobs = render(k, a.logprobs, a.text) if body.logprobs is not None else None
        if body.scores_prompt and a.prompt is not None:
            logprobs = lp.joined(lp.echoed_prompt(served.path, *a.prompt, prefixes[k]), logprobs)
        choices.append({"index": k, "text": prefixes[k] + a.text, "finish_reason": a.finish_reason,
                        "logprobs": logprobs, **_prompt_logprobs(body, served, a)})
    return {"id": cid, "object": "text_completion", "created": created, "model": served.id, "choices": choices,
            "usage": usage(_prompt_tokens(tickets, body.n), sum(a.tokens for a in answers),
                           cached_tokens(answers, body.n))}


async def _chat_submission(body: ChatCompletionRequest, request: Request, served: ServedModel,
                           max_tokens: int) -> Submission:
    """The chat as the model reads it (its template) and as the predictor reads it (the system
    text as the instruction, the conversation as the input)."""
    texts = [_content_text(i, m) for i, m in enumerate(body.messages)]
    check_text_size(request.app.state.settings.max_text_chars,
                    [(f"messages.{i}.content", t) for i, t in enumerate(texts)])
    for i, m in enumerate(body.messages):
        if m.role == "tool" or m.tool_calls:
            raise APIError(400, "tool calls and tool messages are not supported by cohort",
                           code="unsupported_parameter", param=f"messages.{i}")
    system, convo = split_chat([(m.role, t) for m, t in zip(body.messages, texts, strict=True)])
    if not convo.strip():
        raise APIError(400, "messages need at least one non-system message", code="invalid_value",
                       param="messages")
    if await run_in_threadpool(has_chat_template, served.path):
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": t,
                     **({"name": m.name} if m.name else {})} for m, t in zip(body.messages, texts, strict=True)]
        prompt, ids = await run_in_threadpool(chat_prompt_ids, messages, served.path)
        return _submission(body, request, served, max_tokens, instruction=system, user_input=convo, prompt=prompt,
                           prompt_ids=ids, param="messages")
    return _submission(body, request, served, max_tokens, instruction=system, user_input=convo,
                       prompt=builtin_chat_prompt(system, convo), param="messages")


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    received = time.monotonic()
    st = request.app.state
    _refuse_unsupported(body)
    _refuse_streamed_prompt_scores(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", code="invalid_value", param="top_logprobs")
    served = await st.pool.resolve(body.model)
    max_tokens = body.max_completion_tokens or body.max_tokens or st.settings.default_max_tokens
    subs = _copies(body, await _chat_submission(body, request, served, max_tokens))
    tickets, relays = await _admit(request, served, subs, "chat", received)
    cid, created = f"chatcmpl-{tickets[0].request.id}", int(tickets[0].request.arrival)
    render: Callable[[int, list, str], dict | None] | None = (
        lambda _i, pairs, _text: lp.chat(served.path, pairs) if pairs else None) if body.logprobs else None
    if body.stream:
        return sse_response(relays, Chunks("chat", cid, created, served.id, body.include_usage, render),
                            prompt_tokens=_prompt_tokens(tickets, body.n), n=body.n)
    answers = await collect_all(relays)
    choices = [{"index": k, "message": {"role": "assistant", "content": a.text},
                "logprobs": render(k, a.logprobs, a.text) if render else None, "finish_reason": a.finish_reason,
                **_prompt_logprobs(body, served, a)}
               for k, a in enumerate(answers)]
    return {"id": cid, "object": "chat.completion", "created": created, "model": served.id, "choices": choices,
            "usage": usage(_prompt_tokens(tickets, body.n), sum(a.tokens for a in answers),
                           cached_tokens(answers, body.n))}
