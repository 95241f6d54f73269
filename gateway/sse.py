"""OpenAI streaming (``stream: true``) as server-sent events, for chat and text completions.

The sequence: for chat, an opening chunk per choice with ``delta.role = "assistant"`` sent at
once (before any token exists, so clients see the response start); with ``echo`` (completions),
a chunk per choice with its prompt; one chunk per piece of new text (``choices[0].delta.content``
for chat, ``choices[0].text`` for completions), with its tokens' ``logprobs`` when asked for; a
final chunk per choice with ``finish_reason``; with ``stream_options.include_usage``, a usage
chunk (``choices: []``) — and then every other chunk carries ``usage: null``, as OpenAI does;
then ``data: [DONE]``. Each chunk holds one choice, named by its ``index``: with ``n`` > 1 or
several prompts the choices' chunks interleave as their tokens arrive.

A failure after the stream started cannot change the HTTP status any more: it is sent as an
SSE event ``data: {"error": {...}}`` (the same body as an HTTP error) followed by ``[DONE]``,
and the request's other choices are withdrawn.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

import anyio
from fastapi.responses import StreamingResponse

from gateway.auth import stream_usage
from gateway.errors import APIError
from gateway.relay import Answer, Piece, Relay

DONE = "data: [DONE]\n\n"
HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering of tokens


def event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


def cached_tokens(answers: Sequence[Answer | None], n: int = 1) -> int:
    """Usage's cached prompt tokens, each prompt counted once (its first choice) as its tokens are."""
    return sum(a.cached_tokens for a in answers[::max(1, n)] if a is not None)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage object; ``prompt_tokens_details.cached_tokens``: prompt tokens whose KV the
    prefix cache had (OpenAI's field for its own prompt caching)."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Chunks:
    """The chunk shapes of one streamed response. ``logprobs(index, pairs, text)`` renders a
    choice's logprobs for a chunk of text (None: the request did not ask for them); it sees every
    chunk of the choice in order, also those without tokens (offsets count on)."""

    kind: Literal["chat", "completions"]
    id: str
    created: int
    model: str
    include_usage: bool = False
    logprobs: Callable[[int, list, str], dict | None] | None = None

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        c: dict[str, Any] = {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                             "choices": choices}
        if self.include_usage:
            c["usage"] = None
        return c

    def _choice(self, index: int, text: str | None, finish_reason: str | None, role: bool = False,
                logprobs: list | None = None) -> dict[str, Any]:
        lp = self.logprobs(index, logprobs or [], text or "") if self.logprobs is not None and text is not None \
            else None
        if self.kind == "chat":
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish_reason}
        return {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish_reason}

    def opening(self, index: int = 0) -> dict[str, Any] | None:
        """Chat's role chunk; completions have none (their first chunk is the first text)."""
        return self._chunk([self._choice(index, None, None, role=True)]) if self.kind == "chat" else None

    def delta(self, text: str, index: int = 0, logprobs: list | None = None) -> dict[str, Any]:
        return self._chunk([self._choice(index, text, None, logprobs=logprobs)])

    def finish(self, finish_reason: str, index: int = 0) -> dict[str, Any]:
        return self._chunk([self._choice(index, None, finish_reason)])

    def usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        return {**self._chunk([]), "usage": usage(prompt_tokens, completion_tokens, cached_tokens)}


async def merged(relays: Sequence[Relay]) -> AsyncIterator[tuple[int, Piece | Answer]]:
    """The pieces of several answers as they arrive, each with its relay's index, and each
    relay's ``Answer`` when it ends. The first failure is raised; closing the iterator, or a
    failure, withdraws every relay not yet answered."""
    if len(relays) == 1:  # one choice (nearly every request): no pump task and queue between it and its reader
        relay = relays[0]
        try:
            async with aclosing(relay.pieces()) as pieces:
                async for piece in pieces:
                    yield 0, piece
            assert relay.answer is not None
            yield 0, relay.answer
        finally:
            with anyio.CancelScope(shield=True):  # a cancelled stream must still withdraw its request
                await relay.abandon()
        return
    queue: asyncio.Queue[tuple[int, Piece | Answer | BaseException]] = asyncio.Queue()
    # anyio scopes, not Task.cancel(): their cancellation is re-delivered at every await until the
    # task ends (the Redis client may absorb a single CancelledError in a blocking read).
    scopes = [anyio.CancelScope() for _ in relays]

    async def pump(i: int, relay: Relay) -> None:
        with scopes[i]:
            try:
                async with aclosing(relay.pieces()) as pieces:
                    async for piece in pieces:
                        queue.put_nowait((i, piece))
                assert relay.answer is not None
                queue.put_nowait((i, relay.answer))
            except Exception as e:  # handed to the consumer, which raises it
                queue.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(relays)]
    try:
        left = len(relays)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            left -= isinstance(item, Answer)
            yield i, item
    finally:
        with anyio.CancelScope(shield=True):  # a cancelled stream must still withdraw its requests
            for scope in scopes:
                scope.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for r in relays:
                await r.abandon()


async def collect_all(relays: Sequence[Relay]) -> list[Answer]:
    """Every answer (a non-streaming request with several choices); the first failure is raised
    and the other choices are withdrawn."""
    async with aclosing(merged(relays)) as items:
        async for _ in items:
            pass
    return [r.answer for r in relays]  # type: ignore[misc]


async def sse_events(relays: Relay | Sequence[Relay], chunks: Chunks, prefixes: Sequence[str] = (),
                     prompt_tokens: int | None = None, n: int = 1) -> AsyncIterator[str]:
    """The SSE body of one request; closing or cancelling it before the end (client gone)
    withdraws every choice. ``prefixes``: text each choice starts with (``echo``);
    ``prompt_tokens``: the usage's (default: every choice's prompt counted)."""
    relays = [relays] if isinstance(relays, Relay) else list(relays)
    try:
        for i in range(len(relays)):
            if (first := chunks.opening(i)) is not None:
                yield event(first)
        for i, prefix in enumerate(prefixes):
            if prefix:
                yield event(chunks.delta(prefix, i))
        try:
            async with aclosing(merged(relays)) as items:
                async for i, item in items:
                    if isinstance(item, Answer):
                        yield event(chunks.finish(item.finish_reason, i))
                    else:
                        yield event(chunks.delta(item.text, i, item.logprobs))
            prompt = sum(r.ticket.request.input_tokens for r in relays) if prompt_tokens is None else prompt_tokens
            completion = sum(r.answer.tokens for r in relays if r.answer)
            stream_usage(prompt, completion)  # the API key's tokens (gateway.auth), asked for or not
            if chunks.include_usage:
                yield event(chunks.usage(prompt, completion, cached_tokens([r.answer for r in relays], n)))
        except APIError as e:
            yield event(e.body())
        yield DONE
    finally:
        with anyio.CancelScope(shield=True):
            for r in relays:
                await r.abandon()


class EventStream(StreamingResponse):
    """Starlette's streaming response without its task group: the body is sent from the request's
    own task, and one plain task waits for the client's ``http.disconnect`` and cancels it (the
    body's generator then withdraws its requests, as ``sse_events`` says).

    Starlette runs the body in a child of an anyio task group and stops it through the group's
    cancel scope, whose delivery schedules itself again until the task ends: with the scope's
    entry and exit and the group's bookkeeping, 4 % of the gateway's Python calls for a streamed
    request (about 170 of 4,000, counted with cProfile at 30 requests a second). A single cancel
    is enough here: the body waits on the gateway's own stream readers, never in a Redis read that
    could swallow it, and those readers also ask whether the client is there once a
    ``disconnect_check_s``."""

    async def __call__(self, scope, receive, send) -> None:
        me = asyncio.current_task()
        left = False

        async def listen() -> None:
            nonlocal left
            while (await receive())["type"] != "http.disconnect":
                pass
            left = True
            me.cancel()

        listener = asyncio.get_running_loop().create_task(listen())
        try:
            await self.stream_response(send)
        except asyncio.CancelledError:
            if not left:
                raise
            if hasattr(me, "uncancel"):  # Python 3.11+: the cancel was ours, not the server's
                me.uncancel()
        finally:
            listener.cancel()


def sse_response(relays: Relay | Sequence[Relay], chunks: Chunks, prefixes: Sequence[str] = (),
                 prompt_tokens: int | None = None, n: int = 1) -> EventStream:
    return EventStream(sse_events(relays, chunks, prefixes, prompt_tokens, n), media_type="text/event-stream",
                       headers=HEADERS)
