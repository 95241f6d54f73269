"""The OpenAPI document as the API really answers: validation errors are 400 (gateway.errors), not
FastAPI's default 422, and every route declares the error statuses it can send, each with the one
error body (``ErrorResponse``) and, for 429/503, the ``Retry-After`` header.

Which route sends which status is stated here, next to the reason, so the document and the
behaviour are checked together (tests/gateway/test_schemathesis.py runs schemathesis over it).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from gateway.errors import RETRY_AFTER_S

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["error"],
    "properties": {"error": {
        "type": "object", "required": ["message", "type"],
        "properties": {
            "message": {"type": "string", "description": "What went wrong, written for the client."},
            "type": {"type": "string"},
            "param": {"type": ["string", "null"], "description": "The request field at fault."},
            "code": {"type": ["string", "null"]},
            "request_id": {"type": "string", "description": "Also sent as the X-Request-Id header."},
        }}},
}

GENERATION = {"/v1/generate", "/v1/completions", "/v1/chat/completions"}
REASONS = {
    400: "Invalid request: a field out of range or unsupported (named in error.param), a prompt that is "
         "empty once tokenized, too long, or that cannot fit an instance's KV memory.",
    401: "Missing or wrong admin token (/admin), or API key (/v1, once keys are configured or created).",
    404: "Unknown model (model_not_found) or unknown resource.",
    409: "The batch cannot be cancelled in its status (completed, failed, expired).",
    413: "Request body larger than any valid request (COHORT_MAX_TEXT_CHARS).",
    429: "The queue is full (queue_full): refused, or shed for a more urgent request. Retry after Retry-After.",
    500: "The worker failed the batch that ran this request (batch_failed).",
    503: "No live instance of the model yet, an instance lost too often, or Redis unavailable for a moment.",
    504: "No answer within COHORT_REQUEST_TIMEOUT_S; the request was withdrawn.",
    507: "This request alone does not fit an instance's memory (out_of_memory).",
}


def statuses(path: str, method: str) -> list[int]:
    """The error statuses one route answers."""
    if path.startswith("/admin"):  # behind the bearer token; a body can be invalid, a version unknown
        return [401] + ([400] if method == "post" else []) + ([404] if "{" in path else [])
    if path in GENERATION:
        out = [400, 401, 413, 429, 500, 503, 504, 507]
        return out + [404] if path != "/v1/generate" else out
    if path.startswith(("/v1/files", "/v1/batches")):  # keys (401, 429), another key's object (404)
        out = [401, 429] + ([404] if "{" in path or method == "post" else [])
        out += [400] if "{" not in path else []
        out += [413] if path == "/v1/files" and method == "post" else []
        return out + ([409] if path.endswith("/cancel") else [])
    if path.startswith("/v1/models"):
        return [401, 404, 503] if "{" in path else [401, 503]
    if path == "/health":
        return [503]
    return []


def _response(status: int) -> dict[str, Any]:
    r: dict[str, Any] = {"description": REASONS[status],
                         "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}}
    if status in RETRY_AFTER_S:
        r["headers"] = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                        "schema": {"type": "integer"}}}
    return r


def build(app: FastAPI, include_admin: bool = False) -> dict[str, Any]:
    """The OpenAPI document; the admin routes only in the one served behind the admin token
    (``GET /admin/openapi.json``): the public one does not advertise them."""
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    if not include_admin:
        schema["paths"] = {p: item for p, item in schema.get("paths", {}).items() if not p.startswith("/admin")}
    comps = schema.setdefault("components", {}).setdefault("schemas", {})
    comps.pop("HTTPValidationError", None)
    comps.pop("ValidationError", None)
    comps["ErrorResponse"] = ERROR_SCHEMA
    for path, item in schema.get("paths", {}).items():
        for method, op in item.items():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            for status in statuses(path, method):
                responses.setdefault(str(status), _response(status))
    return schema


def install(app: FastAPI) -> None:
    """Serve ``build``'s public document at /openapi.json (built once, on first request)."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = build(app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
