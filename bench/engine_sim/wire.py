"""vLLM's response bodies: SSE chunks, the usage chunk, whole answers, error bodies.

A streamed chunk is assembled from bytes fixed per request (the head up to the text, written
once) and the tokens' pre-escaped text (``TokenTable.escaped_of``): no ``json.dumps`` of a dict per
token, which is most of what a fixed-delay stream would otherwise cost the server's core.

Shapes, as vLLM's OpenAI server writes them: ``data: {...}\\n\\n`` per chunk and ``data: [DONE]``
last; completions choices carry ``text``, chat choices a ``delta`` (the first chunk the assistant
role with empty content); with ``return_token_ids`` each choice carries the chunk's ``token_ids``
and the first chunk the prompt's ids (on the completions choice, at the top of a chat chunk);
``usage`` comes in a last chunk with no choices when ``stream_options.include_usage`` is set, and
always in a whole answer, with ``prompt_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

DONE = b"data: [DONE]\n\n"


def _ids(ids: Sequence[int]) -> str:
    return "[" + ",".join(map(str, ids)) + "]"


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": {"cached_tokens": max(cached_tokens, 0)}}


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object (vLLM's ``ErrorResponse``)."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class Reply:
    """One request's answer in vLLM's shapes: ``chat`` or completions, streamed or whole."""

    def __init__(self, chat: bool, request_id: str, created: int, model: str, return_token_ids: bool,
                 prompt_ids: Sequence[int]) -> None:
        self.chat = chat
        self.request_id = request_id
        self.created = created
        self.model = model
        self.return_token_ids = return_token_ids
        self.prompt_ids = prompt_ids
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._top = f'{{"id":"{request_id}","object":"{obj}","created":{created},"model":{json.dumps(model)},'
        self._head = ("data: " + self._top + '"choices":[{"index":0,'
                      + ('"delta":{"content":"' if chat else '"text":"')).encode()
        self._mid = ('"}' if chat else '"') + ',"logprobs":null,"finish_reason":'
        self._first = True

    def first_chunk(self) -> bytes | None:
        """The chat role chunk vLLM sends before any content; None for completions."""
        if not self.chat:
            return None
        top = self._top
        if self.return_token_ids:
            top += f'"prompt_token_ids":{_ids(self.prompt_ids)},'
            self._first = False
        return (f'data: {top}"choices":[{{"index":0,"delta":{{"role":"assistant","content":""}},'
                f'"logprobs":null,"finish_reason":null}}]}}\n\n').encode()

    def chunk(self, escaped_text: str, ids: Sequence[int], finish: str | None) -> bytes:
        """One SSE chunk of tokens (their text already JSON-escaped)."""
        tail = self._mid + ("null" if finish is None else f'"{finish}"')
        if not self.chat:
            tail += ',"stop_reason":null'
        if self.return_token_ids:
            tail += f',"token_ids":{_ids(ids)}'
            if self._first and not self.chat:
                tail += f',"prompt_token_ids":{_ids(self.prompt_ids)}'
        self._first = False
        return self._head + (escaped_text + tail + "}]}\n\n").encode()

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> bytes:
        u = json.dumps(usage_body(prompt_tokens, completion_tokens, cached_tokens), separators=(",", ":"))
        return f'data: {self._top}"choices":[],"usage":{u}}}\n\n'.encode()

    def whole(self, text: str, ids: Sequence[int], finish: str | None, cached_tokens: int) -> dict[str, Any]:
        """The non-streaming answer."""
        u = usage_body(len(self.prompt_ids), len(ids), cached_tokens)
        extra: dict[str, Any] = {"token_ids": list(ids)} if self.return_token_ids else {}
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": finish, "stop_reason": None, **extra}
            body = {"id": self.request_id, "object": "chat.completion", "created": self.created,
                    "model": self.model, "choices": [choice], "usage": u}
            if self.return_token_ids:
                body["prompt_token_ids"] = list(self.prompt_ids)
            return body
        if self.return_token_ids:
            extra["prompt_token_ids"] = list(self.prompt_ids)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish, "stop_reason": None,
                  "prompt_logprobs": None, **extra}
        return {"id": self.request_id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": [choice], "usage": u}
