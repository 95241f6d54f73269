"""An aiohttp app on a free loopback port, for tests that talk to a server speaking an engine's
HTTP API (the benchmark client, the upstream probe, `bench upstream` end to end)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from aiohttp import web


@asynccontextmanager
async def serving(app: web.Application) -> AsyncIterator[str]:
    """Serve ``app`` on 127.0.0.1 for the block; yields its base URL ending in /v1."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"
    finally:
        await runner.cleanup()


def answer(make: Callable[[], web.Response]):
    """A GET handler answering ``make()``, a fresh response each time (aiohttp wants coroutines)."""
    async def handler(_request: web.Request) -> web.Response:
        return make()
    return handler


async def open_sse(request: web.Request, *, key: str | None = None, status: int = 200,
                   message: str = "no") -> web.StreamResponse:
    """A scripted engine's answer opened: 401 without ``Bearer key`` (vLLM's ``--api-key``), an
    error body with ``status`` when that is not 200, else an event stream, prepared. The caller
    returns at once unless its status is 200."""
    if key is not None and request.headers.get("Authorization") != f"Bearer {key}":
        return web.json_response({"error": "Unauthorized"}, status=401)
    if status != 200:
        return web.json_response({"error": {"message": message}}, status=status)
    r = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await r.prepare(request)
    return r
