"""What the fixed-delay engine costs its core per streamed request: ``cohort engine-sim cpu-cost``.

The engine is started as its own process (``cohort engine-sim serve --ttft-ms … --itl-ms …``),
a plain aiohttp client streams the requests from this process, and the server's CPU time (user +
system, from psutil) is read before and after: the difference over the requests is its cost per
request, start-up excluded.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from typing import Any

import aiohttp
import psutil

from procstack.stack import free_port


def spawn(args: list[str], port: int, timeout_s: float = 60.0) -> subprocess.Popen:
    """``cohort engine-sim serve`` with ``args`` on ``port``, waited for until /health answers."""
    proc = subprocess.Popen([sys.executable, "-m", "bench.engine_sim.cli", "serve",
                             "--port", str(port), "--log-level", "WARNING", *args])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine-sim exited with {proc.returncode} before serving")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("engine-sim did not start in time")


async def _drive(base: str, requests: int, tokens: int, concurrency: int) -> int:
    body = {"model": "sim-model", "prompt": "a benchmark prompt of a few words", "max_tokens": tokens,
            "stream": True}
    sem = asyncio.Semaphore(concurrency)
    got = 0

    async def one(session: aiohttp.ClientSession) -> None:
        nonlocal got
        async with sem, session.post(f"{base}/v1/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    got += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as s:
        await one(s)   # warm-up: the connection and the server's first-request paths
        got = 0
        await asyncio.gather(*(one(s) for _ in range(requests)))
    return got


def measure(requests: int = 600, tokens: int = 40, concurrency: int = 50, ttft_ms: float = 20.0,
            itl_ms: float = 5.0) -> dict[str, Any]:
    port = free_port()
    proc = spawn(["--ttft-ms", str(ttft_ms), "--itl-ms", str(itl_ms)], port)
    try:
        ps = psutil.Process(proc.pid)
        asyncio.run(_drive(f"http://127.0.0.1:{port}", 1, 2, 1))
        c0, t0 = ps.cpu_times(), time.monotonic()
        chunks = asyncio.run(_drive(f"http://127.0.0.1:{port}", requests, tokens, concurrency))
        c1, wall = ps.cpu_times(), time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(10)
    cpu = (c1.user - c0.user) + (c1.system - c0.system)
    return {"requests": requests, "tokens_per_request": tokens, "concurrency": concurrency, "ttft_ms": ttft_ms,
            "itl_ms": itl_ms, "chunks_received": chunks, "wall_s": round(wall, 3), "server_cpu_s": round(cpu, 3),
            "server_cpu_ms_per_request": round(1000 * cpu / requests, 3),
            "server_cpu_us_per_token": round(1e6 * cpu / (requests * tokens), 2)}
