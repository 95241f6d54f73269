"""The admin bearer-token check shared by every /admin route."""

from __future__ import annotations

import secrets

from fastapi import Request
from fastapi.responses import JSONResponse

from gateway.errors import error_response


def admin_denied(request: Request, token: str | None) -> JSONResponse | None:
    """None when ``Authorization: Bearer <token>`` matches (constant-time), else a 401 response."""
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if not token or scheme.lower() != "bearer" or not secrets.compare_digest(given.strip(), token):
        resp = error_response(401, "invalid or missing admin token (Authorization: Bearer <COHORT_ADMIN_TOKEN>)",
                              code="invalid_api_key")
        resp.headers["WWW-Authenticate"] = "Bearer"
        return resp
    return None
