"""Request patterns the e2e tests share."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from cohort import bus

KV_BYTES_PER_TOKEN = 2048  # Δ of the built-in model (2 · 4 layers · 2 kv heads · 32 · fp32)


def behind_a_blocker(stack, blocker: dict[str, Any], bodies: list[dict[str, Any]]):
    """Send ``blocker``, wait until it runs on the only instance, then send ``bodies`` at once:
    they all wait and leave as one batch. (blocker response, responses)."""

    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=300) as c:
            first = asyncio.create_task(c.post("/v1/generate", json=blocker))
            for _ in range(200):  # until the blocker is running
                if stack.redis.hlen(bus.pool_keys("default").inflight):
                    break
                await asyncio.sleep(0.02)
            rest = await asyncio.gather(*(c.post("/v1/generate", json=b) for b in bodies))
            return await first, rest

    return asyncio.run(scenario())


def leave_after_first_text(stream) -> str:
    """Read a streamed completion until its first text, then close it (the client leaves); the
    request's id."""
    request_id = None
    for chunk in stream:
        request_id = chunk.id.removeprefix("cmpl-")
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()
    return request_id
