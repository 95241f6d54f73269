"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code", "request_id"}}`` with the
right status — the one place an error body is written.

Every message is written for the client: validation errors are rephrased from pydantic's, and an
unexpected exception answers a fixed text (its details go to the log, under the request id). The
request id (``X-Request-Id``: the client's own when it sends a sane one, else a new one) is on
every response's headers and in every error body, so a client's report can be found in the logs.
A 429 or 503 carries ``Retry-After``: the condition is passing (a full queue, no instance yet, Redis
restarting) and the client should come back rather than give up.
"""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cohort.types import new_id

log = logging.getLogger("cohort.gateway")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
          503: "service_unavailable", 504: "timeout"}
RETRY_AFTER_S = {429: 1, 503: 2}  # seconds a client should wait before retrying
REQUEST_ID_HEADER = "x-request-id"
_CLIENT_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class APIError(Exception):
    """Raise anywhere in a view to answer with an OpenAI-style error body."""

    def __init__(self, status: int, message: str, code: str | None = None, param: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param
        self.type = type_ or _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")

    def body(self, request_id: str | None = None) -> dict:
        err = {"message": _printable(self.message), "type": self.type, "param": _printable(self.param),
               "code": self.code}
        if request_id:
            err["request_id"] = request_id
        return {"error": err}

    @property
    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(RETRY_AFTER_S[self.status])} if self.status in RETRY_AFTER_S else {}


def _printable(text: str | None) -> str | None:
    """Text that can be encoded as UTF-8: a message or param may quote a client's string, and a
    lone surrogate in it would make the error itself fail to render."""
    return None if text is None else text.encode("utf-8", "backslashreplace").decode("utf-8")


def request_id(request: Request) -> str | None:
    return getattr(request.state, "request_id", None)


def error_response(status: int, message: str, code: str | None = None, param: str | None = None,
                   request: Request | None = None) -> JSONResponse:
    return api_error_response(APIError(status, message, code, param), request)


def api_error_response(e: APIError, request: Request | None = None) -> JSONResponse:
    return JSONResponse(e.body(request_id(request) if request is not None else None), status_code=e.status,
                        headers=e.headers)


class RequestIds:
    """ASGI middleware: gives every HTTP request an id (``request.state.request_id``) and sends it
    back in ``X-Request-Id``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = dict(scope.get("headers") or []).get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1")
        rid = sent if _CLIENT_ID.fullmatch(sent) else new_id("http")
        scope.setdefault("state", {})["request_id"] = rid

        async def with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (REQUEST_ID_HEADER.encode(), rid.encode())]
            await send(message)

        await self.app(scope, receive, with_id)


def _validation_message(first: dict) -> tuple[str, str | None, str]:
    """(message, param, code) of pydantic's first error, in words for the client."""
    ctx_error = (first.get("ctx") or {}).get("error")
    loc = [str(x) for x in first.get("loc", []) if x != "body"]
    param = getattr(ctx_error, "param", None) or ".".join(loc) or None
    if first.get("type") == "json_invalid":
        return "request body is not valid JSON", None, "invalid_json"
    msg = str(first.get("msg", "invalid request")).removeprefix("Value error, ")  # our validators' text
    if param is None and first.get("type") == "model_attributes_type":
        return "the request body must be a JSON object", None, "invalid_json"
    return (f"{param}: {msg}" if param else msg), param, getattr(ctx_error, "code", None) or "invalid_value"


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> JSONResponse:
        return api_error_response(e, request)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        errs = e.errors()
        msg, param, code = _validation_message(errs[0] if errs else {})
        return error_response(400, msg, code=code, param=param, request=request)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        resp = error_response(e.status_code, str(e.detail), code=None, request=request)
        resp.headers.update(getattr(e, "headers", None) or {})
        return resp

    @app.exception_handler(RedisConnectionError)
    @app.exception_handler(RedisTimeoutError)
    async def _redis_down(request: Request, e: Exception) -> JSONResponse:
        log.warning("request %s: Redis unavailable (%s)", request_id(request), e)
        return error_response(503, "the queue is unavailable for a moment; retry shortly", code="unavailable",
                              request=request)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> JSONResponse:
        log.exception("request %s: unhandled error", request_id(request))
        return error_response(500, "internal server error; quote the request id when reporting it",
                              code="internal_error", request=request)
