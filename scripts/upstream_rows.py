"""Benchmark (not a test): an upstream engine's time per token by the rows it decodes at once.

Sends k parallel streamed completions of ``tokens`` tokens each (``ignore_eos``) for k = 1, 2, 4,
8, 12, 16, one k after the other, and prints each row's mean time per token and the engine's tokens
per second at that k. Where tokens/s keeps growing with k, another row is nearly free throughput
and cohort must not hold the engine below it (issue 37); where it flattens, rows only slow each
other (docs/notes/upstream.md "A slower machine"). Mind the engine's KV: past it, rows are preempted.

    .venv/bin/python scripts/upstream_rows.py http://127.0.0.1:8100/v1 [STREAM_INTERVAL] [TOKENS]

``STREAM_INTERVAL``: vLLM's per-request ``stream_interval`` (0: the server's default), as cohort's
upstream worker asks for (``COHORT_UPSTREAM_STREAM_INTERVAL``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp


async def _one(http: aiohttp.ClientSession, url: str, model: str, tokens: int, interval: int) -> float:
    body = {"model": model, "prompt": "hello world " * 20, "max_tokens": tokens, "ignore_eos": True, "stream": True}
    if interval:
        body["stream_interval"] = interval
    first = None
    async with http.post(f"{url}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if line.startswith(b"data: {") and first is None:
                first = time.perf_counter()
    return (time.perf_counter() - first) / max(1, tokens - 1)


async def main(url: str, interval: int, tokens: int) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/models") as r:
            model = json.loads(await r.text())["data"][0]["id"]
        for k in (1, 2, 4, 8, 12, 16):
            per = sum(await asyncio.gather(*[_one(http, url, model, tokens, interval) for _ in range(k)])) / k
            print(f"rows {k:2d}: {per * 1e3:6.2f} ms per token, {k / per:6.0f} tokens/s", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1].rstrip("/"), int(sys.argv[2]) if len(sys.argv) > 2 else 0,
                     int(sys.argv[3]) if len(sys.argv) > 3 else 200))
