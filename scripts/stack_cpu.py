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
from pathlib import Path

from bench.front_bench import CpuMeter, cohort_processes
from bench.live_stack import parse_env, spawned_stack
from bench.upstream_bench import cohort_body, replay_streams, served_model, summarize
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime


def main(engine: str, rate: float, n: int, env: dict[str, str]) -> None:
    files = [str(p) for p in data_files()]
    wl = make_workload(WorkloadConfig(files=files, requests=n, rate=rate, seed=0, max_tokens=256),
                       AnalyticBatchTime(), build_rows(files, None))
    with spawned_stack("spf", {"COHORT_UPSTREAMS": engine, **env}, Path("var/bench/stack-cpu")) as url:
        meter = CpuMeter(cohort_processes())  # its gateway, batcher, workers and embedded Redis
        body = cohort_body(wl, served_model(f"{url}/v1"))
        asyncio.run(replay_streams(wl, f"{url}/v1", body))  # warm: first requests load lazily
        meter.start()
        res = asyncio.run(replay_streams(wl, f"{url}/v1", body))
        used = meter.stop()
    wall = used.pop("wall")
    m = summarize(wl, res)
    print(f"{n} requests at {rate:g} req/s: {m['throughput_rps']:.2f} req/s done, p50 e2e {m['p50_latency_s']:.3f} s, "
          f"p50 TTFT {m['p50_ttft_s']:.3f} s, wall {wall:.1f} s")
    for r, cpu in used.items():
        print(f"  {r:>8}: {1000 * cpu / n:6.2f} ms of CPU per request ({100 * cpu / wall:4.1f} % of a core)")
    total = sum(used.values())
    print(f"  {'all':>8}: {1000 * total / n:6.2f} ms per request ({100 * total / wall:4.1f} % of a core)")


if __name__ == "__main__":
    args = sys.argv[1:]
    extra = [a for a in args if "=" in a]
    plain = [a for a in args if "=" not in a]
    main(plain[0], float(plain[1]), int(plain[2]) if len(plain) > 2 else 300, parse_env(extra))
