"""Rules for hostile input that field types alone do not state, each with one owner here. They run
before anything is tokenized or reaches a model, and each refusal is a 400 (413 for a body too
large) naming the field:

- **valid text**: every string of a body — values and keys, at any depth — is valid Unicode. JSON
  can carry a lone surrogate as an escape (``"\\ud800"``), which Python decodes into a ``str`` that
  the tokenizer, the log DB and the response encoder all fail on (``check_unicode``, run by the
  request models, gateway.schemas);
- **size**: the text of one request (instruction + input, every prompt, every message, token-id
  prompts counted one character per id) is at most ``COHORT_MAX_TEXT_CHARS`` characters, checked
  before tokenizing (``check_text_size``, called by each view); the HTTP body itself is bounded by
  the same setting (``BodyLimit``, from ``Content-Length``), so a huge body is refused unread;
- emptiness is decided by tokens, not characters: gateway.submit refuses a prompt that tokenizes
  to nothing (``" "``, ``"\\u200b"``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.errors import APIError, error_response

BODY_BYTES_PER_CHAR = 8  # JSON escapes: "\ud83d\ude00" is 12 bytes for one character (2 UTF-16 units)
BODY_SLACK_BYTES = 1 << 20  # token-id prompts, sampling fields, message framing


class InvalidText(ValueError):
    """A string that is not valid Unicode; ``param`` names where it is (gateway.errors reads it)."""

    def __init__(self, param: str) -> None:
        super().__init__("text is not valid Unicode (a lone surrogate, e.g. an unpaired \\ud800 escape)")
        self.param, self.code = param, "invalid_text"


def _bad(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_unicode(value: Any, path: str = "") -> None:
    """Raise InvalidText naming the first string (or key) at any depth that is not valid Unicode."""
    if isinstance(value, str):
        if _bad(value):
            raise InvalidText(path or "body")
    elif isinstance(value, dict):
        for k, v in value.items():
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str) and _bad(k):
                raise InvalidText(path or "body")
            check_unicode(v, where)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, f"{path}.{i}" if path else str(i))


def check_text_size(max_chars: int, fields: Iterable[tuple[str, str | list[int]]]) -> None:
    """Refuse a request whose text fields (name, text or token ids) together exceed ``max_chars``;
    the field that crosses the limit is named."""
    total = 0
    for param, text in fields:
        total += len(text)
        if total > max_chars:
            raise APIError(400, f"the request's text exceeds {max_chars} characters (COHORT_MAX_TEXT_CHARS); "
                           "shorten it", code="text_too_long", param=param)


def body_limit(max_chars: int) -> int:
    return max_chars * BODY_BYTES_PER_CHAR + BODY_SLACK_BYTES


class BodyLimit:
    """ASGI middleware: no request body larger than any valid one is ever read. A body that
    declares its length is answered 413 before it is read; one that does not (chunked) is read
    up to the limit and answered 413 as soon as it passes it, else handed on whole."""

    def __init__(self, app: ASGIApp, max_chars: int, large: dict[str, int] | None = None) -> None:
        self.app, self.default = app, body_limit(max_chars)
        # routes whose bodies are files, not text (POST /v1/files): their own limit, plus multipart framing
        self.large = {path: n + BODY_SLACK_BYTES for path, n in (large or {}).items()}

    def _too_large(self, scope: Scope, limit: int):
        return error_response(413, f"the request body is larger than {limit} bytes",
                              code="body_too_large", request=Request(scope))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.large.get(scope["path"], self.default)
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit():
            if int(declared) > limit:
                await self._too_large(scope, limit)(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before the end
                await self.app(scope, _replay([message]), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > limit:
                await self._too_large(scope, limit)(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}],
                                      receive), send)


def _replay(messages: list[Message], then: Receive | None = None) -> Receive:
    """A ``receive`` that hands out ``messages`` first, then defers to ``then`` (a disconnect
    the app may wait for)."""
    pending = list(messages)

    async def receive() -> Message:
        if pending:
            return pending.pop(0)
        if then is not None:
            return await then()
        return {"type": "http.disconnect"}

    return receive
