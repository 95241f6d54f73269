"""A bare streaming proxy, the floor of `cohort bench front`: what any Python front pays to stream an
engine's tokens to a client, before it schedules anything.

It is uvicorn (uvloop, httptools, no access log) and Starlette with one route per OpenAI endpoint
the bench uses, forwarding the body to the engine with aiohttp and streaming the answer back. Each
SSE event is parsed and encoded again, as a front that reads the tokens (for stop strings, token
counts, a continuation's ids) must. Nothing is queued, predicted, admitted, logged or counted.
Benchmark equipment only: it is never on cohort's serving path.

    python -m bench.front_proxy --engine http://127.0.0.1:8100/v1 --port 8200
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import typer
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

DONE = b"data: [DONE]"


def proxy_app(engine: str) -> Starlette:
    """The proxy in front of ``engine`` (its ``/v1`` base URL)."""
    base = engine.rstrip("/")
    held: dict[str, aiohttp.ClientSession] = {}

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def forward(request: Request) -> Response:
        if "session" not in held:  # made on the server's loop, on its first request; no cap on
            # connections (aiohttp's default of 100 would cap the closed loop, not the proxy's CPU)
            held["session"] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
        body = await request.body()
        resp = await held["session"].post(f"{base}{request.url.path.removeprefix('/v1')}", data=body,
                                          headers={"Content-Type": "application/json"})
        if not resp.content_type.startswith("text/event-stream"):
            try:
                return Response(await resp.read(), status_code=resp.status, media_type=resp.content_type)
            finally:
                resp.release()
        return StreamingResponse(_events(resp), status_code=resp.status, media_type="text/event-stream")

    @asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        yield
        if "session" in held:
            await held["session"].close()

    return Starlette(routes=[Route("/health", health), Route("/v1/completions", forward, methods=["POST"]),
                             Route("/v1/chat/completions", forward, methods=["POST"])], lifespan=lifespan)


async def _events(resp: aiohttp.ClientResponse) -> AsyncIterator[bytes]:
    """The engine's SSE events, each parsed and encoded again."""
    try:
        async for line in resp.content:
            if line.startswith(DONE):
                yield DONE + b"\n\n"
            elif line.startswith(b"data: "):
                yield b"data: " + json.dumps(json.loads(line[6:])).encode() + b"\n\n"
    finally:
        resp.release()


def serve_proxy(engine: str = typer.Option(..., help="The engine's /v1 base URL."),
                host: str = typer.Option("127.0.0.1"), port: int = typer.Option(8200)) -> None:
    uvicorn.run(proxy_app(engine), host=host, port=port, access_log=False, log_level="warning")


if __name__ == "__main__":
    typer.run(serve_proxy)
