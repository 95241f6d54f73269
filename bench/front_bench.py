"""The front benchmark's parts: what a front (cohort, a proxy) costs in front of an engine that
computes nothing, so that every millisecond measured is the front's.

The rig: a zero-compute engine (``cohort engine-sim serve --ttft-ms T --itl-ms I``) and the client
share one core; the front under test has the other core to itself. Each process is pinned when it
starts (a pinned parent's children inherit its CPU set, threads included; pinning a running
process moves only its main thread). CPU is read per process from the kernel (psutil) before and
after a replay, so "front CPU per request" is every process of the front — gateways, batcher,
upstream workers, its Redis — and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import aiohttp
import numpy as np
import psutil

from bench.upstream_bench import StreamResult, _one, summarize
from bench.workload import Workload
from cohort.tokenizer import build_prompt
from procstack.stack import free_port, wait_until_ok

ROLES = ("gateway", "batcher", "worker")  # cohort's processes, by the command each runs


@contextlib.contextmanager
def pinned(cores: set[int]) -> Iterator[None]:
    """Run the block on ``cores``: processes started in it inherit them (the engine, a stack)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cores)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def spawn_engine(ttft_ms: float, itl_ms: float, log: Path, model_name: str = "sim",
                 api_key: str | None = None) -> tuple[subprocess.Popen, str]:
    """The fixed-delay engine on a free port (in the caller's CPU set); its base URL ending in /v1
    (``api_key``: its /v1 routes ask for it, as vLLM's ``--api-key``). One that does not come up is
    stopped before the error is raised: the caller never got it, so nothing else would. Prefer
    ``fixed_delay_engines``, which also stops it once started."""
    port = free_port()
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:  # the child writes to its own copy; this one is closed here
        proc = subprocess.Popen([sys.executable, "-m", "launch.cli", "engine-sim", "serve", "--port", str(port),
                                 "--model-name", model_name, "--ttft-ms", f"{ttft_ms:g}", "--itl-ms", f"{itl_ms:g}",
                                 "--log-level", "WARNING", *(["--api-key", api_key] if api_key else [])],
                                stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"the engine exited with {proc.returncode}:\n{log.read_text()[-2000:]}")

    try:
        if not wait_until_ok(f"{url}/health", 120.0, alive):
            raise TimeoutError(f"the engine at {url} did not answer /health:\n{log.read_text()[-2000:]}")
    except BaseException:  # Ctrl-C included
        stop_processes([proc])
        raise
    return proc, f"{url}/v1"


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM all, then SIGKILL what has not exited ``grace_s`` later (all of them waited for:
    no zombie, no port left taken by an engine stuck in its shutdown)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def fixed_delay_engines(n: int, ttft_ms: float, itl_ms: float, log_dir: Path, model_name: str = "sim",
                        api_key: str | None = None) -> Iterator[list[tuple[subprocess.Popen, str]]]:
    """``n`` fixed-delay engines (``spawn_engine``; logs ``log_dir/engine-{i}.log``), as
    ``(process, base URL)`` pairs, stopped when the block ends however it ends: an engine that
    fails to start, or a set-up after them that fails (a stack in front of them), leaves none of
    them running to hold its port and core into the next test or run."""
    engines: list[tuple[subprocess.Popen, str]] = []
    try:
        for i in range(n):
            engines.append(spawn_engine(ttft_ms, itl_ms, log_dir / f"engine-{i}.log", model_name, api_key))
        yield engines
    finally:
        stop_processes([proc for proc, _ in engines])


def cohort_processes(redis_url: str | None = None) -> dict[str, list[psutil.Process]]:
    """This process's cohort children by role (gateway, batcher, worker) and the stack's Redis
    (the embedded one runs detached: found by its port)."""
    roles: dict[str, list[psutil.Process]] = {r: [] for r in (*ROLES, "redis")}
    port = urlparse(redis_url).port if redis_url else None
    for p in psutil.Process().children():
        try:
            cmd = " ".join(p.cmdline())
        except psutil.NoSuchProcess:
            continue
        if "launch.cli" in cmd and "engine-sim" not in cmd:
            roles[next((r for r in ROLES if f" {r}" in cmd), "worker")].append(p)
            port = port or urlparse(p.environ().get("COHORT_REDIS_URL", "")).port
    if port:
        roles["redis"] = [p for p in psutil.process_iter(["name", "cmdline"])
                          if p.info["name"] == "redis-server" and f":{port}" in " ".join(p.info["cmdline"] or [])]
    return roles


def cpu_seconds(procs: list[psutil.Process]) -> float:
    """User + system CPU of the processes and all their descendants (a gateway's own workers)."""
    total = 0.0
    for p in procs:
        try:
            for q in (p, *p.children(recursive=True)):
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


@dataclass
class CpuMeter:
    """CPU seconds each role spent between ``start`` and ``stop``."""

    roles: dict[str, list[psutil.Process]]

    def start(self) -> None:
        self._t0 = time.monotonic()
        self._before = {r: cpu_seconds(ps) for r, ps in self.roles.items()}
        self._client0 = time.process_time()

    def stop(self) -> dict[str, float]:
        used = {r: cpu_seconds(ps) - self._before[r] for r, ps in self.roles.items()}
        used["client"] = time.process_time() - self._client0
        used["wall"] = time.monotonic() - self._t0
        return used


async def closed_loop(workload: Workload, base_url: str, body_of: Callable[[int, str], dict[str, Any]],
                      concurrency: int, timeout_s: float = 600.0) -> StreamResult:
    """Every request of ``workload`` sent as soon as one of ``concurrency`` clients is free (its
    arrival times are ignored): how many a front serves when it is the bottleneck."""
    n = len(workload)
    nan = np.full(n, math.nan)
    res = StreamResult(nan.copy(), nan.copy(), nan.copy(), np.zeros(n, dtype=np.int64), np.zeros(n),
                       np.zeros(n, dtype=bool), 0.0, {})
    recs = workload.rows.records
    url = f"{base_url.rstrip('/')}/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    todo = iter(range(n))
    t0 = time.perf_counter()

    async def client(session: aiohttp.ClientSession) -> None:
        for i in todo:
            r = recs[int(workload.row[i])]
            await _one(session, url, body_of(i, build_prompt(r.instruction, r.input)), i, res, t0, timeout)

    connector = aiohttp.TCPConnector(limit=concurrency, keepalive_timeout=2.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    res.wall_s = time.perf_counter() - t0
    return res


def measure(workload: Workload, res: StreamResult, used: dict[str, float], front_roles: list[str]) -> dict[str, Any]:
    """One replay's client-side summary, its TTFT p99, and the CPU per request of each process role."""
    m = summarize(workload, res)
    ttft = (res.first - res.sent)[res.ok]
    m["p99_ttft_s"] = float(np.percentile(ttft, 99)) if len(ttft) else math.nan
    done = max(1, m["done"])
    m["cpu_ms_per_request"] = {r: 1000 * used[r] / done for r in (*front_roles, "client")}
    m["front_cpu_ms_per_request"] = sum(m["cpu_ms_per_request"][r] for r in front_roles)
    m["front_core_busy"] = sum(used[r] for r in front_roles) / used["wall"] if used["wall"] > 0 else 0.0
    return m


def against_direct(m: dict[str, Any], direct: dict[str, Any]) -> dict[str, float]:
    """What the front adds to the engine direct, on the same workload: TTFT in ms, e2e as a ratio."""
    def ms(k: str) -> float:
        return 1000 * (m[k] - direct[k])
    return {"added_ttft_p50_ms": ms("p50_ttft_s"), "added_ttft_p99_ms": ms("p99_ttft_s"),
            "mean_e2e_ratio": m["mean_latency_s"] / direct["mean_latency_s"] if direct["mean_latency_s"] else math.nan,
            "done_ratio": m["throughput_rps"] / direct["throughput_rps"] if direct["throughput_rps"] else math.nan}
