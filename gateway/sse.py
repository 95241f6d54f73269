"""OpenAI streaming (``stream: true``) as server-sent events, for chat and text completions.

The sequence: for chat, an opening chunk with ``delta.role = "assistant"`` sent at once (before
any token exists, so clients see the response start); one chunk per piece of new text
(``choices[0].delta.content`` for chat, ``choices[0].text`` for completions); a final chunk with
``finish_reason``; with ``stream_options.include_usage``, a usage chunk (``choices: []``) — and
then every other chunk carries ``usage: null``, as OpenAI does; then ``data: [DONE]``.
A failure after the stream started cannot change the HTTP status any more: it is sent as an
SSE event ``data: {"error": {...}}`` (the same body as an HTTP error) followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

from fastapi.responses import StreamingResponse

from gateway.errors import APIError
from gateway.relay import Relay

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class Chunks:
    """The chunk shapes of one streamed response."""

    kind: Literal["chat", "completions"]
    id: str
    created: int
    model: str
    include_usage: bool = False

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        c: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": choices}
        if self.include_usage:
            c["usage"] = None
        return c

    def _choice(self, text: str | None, finish_reason: str | None, role: bool = False) -> dict[str, Any]:
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}

    def opening(self) -> dict[str, Any] | None:
        """Chat's role chunk; completions have none (their first chunk is the first text)."""
        return self._chunk([self._choice(None, None, role=True)]) if self.kind == "chat" else None

    def delta(self, text: str) -> dict[str, Any]:
        return self._chunk([self._choice(text, None)])

    def finish(self, finish_reason: str) -> dict[str, Any]:
        return self._chunk([self._choice(None, finish_reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage(prompt_tokens, completion_tokens)}


async def sse_events(relay: Relay, chunks: Chunks) -> AsyncIterator[str]:
    """The SSE body of one request; closing or cancelling it before the end (client gone)
    withdraws the request."""
    try:
        if (first := chunks.opening()) is not None:
            yield event(first)
        try:
            async with aclosing(relay.texts()) as texts:
                async for text in texts:
                    yield event(chunks.delta(text))
            answer = relay.answer
            assert answer is not None
            yield event(chunks.finish(answer.finish_reason))
            if chunks.include_usage:
                yield event(chunks.usage(relay.ticket.request.input_tokens, answer.tokens))
        except APIError as e:
            yield event(e.body())
        yield DONE
    finally:
        await relay.abandon()


def sse_response(relay: Relay, chunks: Chunks) -> StreamingResponse:
    return StreamingResponse(sse_events(relay, chunks), media_type="text/event-stream", headers=HEADERS)
