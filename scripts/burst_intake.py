"""How fast a burst reaches the scheduler's queue: N streamed completions offered within SPAN
seconds to a cohort stack in front of the fixed-delay engine (`cohort engine-sim`), and for each
request the time from its offer to its admission (the log DB's ``created``: predicted, recorded,
then pushed to the batcher's queue in the same call). Run from the repository root:

    .venv/bin/python scripts/burst_intake.py [N] [SPAN] [KEY=VALUE ...]

``KEY=VALUE``: settings of the spawned stack (``COHORT_UPSTREAM_STREAMING=gateway``).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import numpy as np
from sqlalchemy import create_engine, text

from bench.front_bench import spawn_engine
from bench.live_stack import parse_env, spawned_stack
from bench.upstream_bench import direct_body, replay_streams, served_model, summarize
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime


def main(n: int, span: float, env: dict[str, str]) -> None:
    files = [str(p) for p in data_files()]
    wl = make_workload(WorkloadConfig(files=files, requests=n, rate=n / span, seed=0, max_tokens=64),
                       AnalyticBatchTime(), build_rows(files, None))
    work = Path("var/bench/burst-intake")
    engine, url = spawn_engine(20, 10, work / "engine.log")
    try:
        with spawned_stack("magnus", {"COHORT_UPSTREAMS": url, **env}, work) as base:
            body = direct_body(wl, served_model(f"{base}/v1"))
            asyncio.run(replay_streams(wl, f"{base}/v1", body))  # warm: lazy loads
            start = time.time()
            res = asyncio.run(replay_streams(wl, f"{base}/v1", body))
            db = create_engine(f"sqlite:///{work / 'magnus' / 'cohort.db'}")
            with db.connect() as c:
                created = sorted(r[0] for r in c.execute(text("SELECT created FROM requests WHERE created >= :t"),
                                                         {"t": start}))
    finally:
        engine.kill()
    offered = np.sort(start + res.sent[~np.isnan(res.sent)])
    lag = np.array(created[:len(offered)]) - offered[:len(created)]  # i-th admitted against i-th offered
    m = summarize(wl, res)
    print(f"{n} requests offered within {span:g} s: last admitted {created[-1] - start:.2f} s after the first offer; "
          f"offer -> admission p50 {np.median(lag):.3f} s, p99 {np.percentile(lag, 99):.3f} s, max {lag.max():.3f} s; "
          f"{m['done']} done, p50 TTFT {m['p50_ttft_s']:.3f} s")


if __name__ == "__main__":
    args = sys.argv[1:]
    plain = [a for a in args if "=" not in a]
    main(int(plain[0]) if plain else 300, float(plain[1]) if len(plain) > 1 else 1.5,
         parse_env([a for a in args if "=" in a]))
