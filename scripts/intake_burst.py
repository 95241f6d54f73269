"""Profile the gateway's intake under a burst (docs/notes/upstream.md "The gateway's intake").

Spawns a stack (spf, the built-in engine, length emulation), sends N streamed chat completions at
once and records the gateway with py-spy (``.venv/bin/pip install py-spy``). Writes ``res.json``
(gateway CPU seconds, the spread of the log DB's ``created``, TTFT, latency) and ``gw.txt``
(py-spy raw) to OUT. Run from the repository root:

    .venv/bin/python scripts/intake_burst.py 300 var/bench/intake [KEY=VALUE ...]
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
from sqlalchemy import create_engine, text

from bench.live_stack import spawned_stack


def _cpu_s(procs: list[psutil.Process]) -> float:
    return sum(p.cpu_times().user + p.cpu_times().system for p in procs)


async def _one(c: httpx.AsyncClient, model: str, prompt: str) -> tuple[float, float | None, float]:
    t0, first = time.perf_counter(), None
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 16, "stream": True}
    async with c.stream("POST", "/v1/chat/completions", json=body) as resp:
        async for line in resp.aiter_lines():
            if first is None and line.startswith("data: "):
                first = time.perf_counter() - t0
    return t0, first, time.perf_counter() - t0


async def _burst(url: str, prompts: list[str]) -> list[tuple[float, float | None, float]]:
    limits = httpx.Limits(max_connections=len(prompts) + 10)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        return await asyncio.gather(*(_one(c, model, p) for p in prompts))


def main(n: int, out: Path, env: dict[str, str]) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in open("../shared/data/bf.jsonl")][:n]
    prompts = [" ".join(str(v) for v in r.values() if isinstance(v, str))[:1500] for r in rows]
    workdir = out / "stack"
    with spawned_stack("spf", env, workdir) as url:
        port = url.rsplit(":", 1)[1]
        procs = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"]]
        gw = next(p for p in procs if "gateway" in p.info["cmdline"] and port in p.info["cmdline"])
        workers = [p for p in procs if p.info["cmdline"][-1] == "worker"]
        batchers = [p for p in procs if p.info["cmdline"][-1] == "batcher" and p.parent() == gw.parent()]
        me = [psutil.Process()]
        spy = subprocess.Popen([".venv/bin/py-spy", "record", "--pid", str(gw.pid), "--rate", "50", "--format", "raw",
                                "-o", str(out / "gw.txt"), "--duration", "40"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(1.5)
        g0, w0, b0, c0, t = _cpu_s([gw]), _cpu_s(workers), _cpu_s(batchers), _cpu_s(me), time.perf_counter()
        got = asyncio.run(_burst(url, prompts))
        wall, g1, w1, b1, c1 = time.perf_counter() - t, _cpu_s([gw]), _cpu_s(workers), _cpu_s(batchers), _cpu_s(me)
        spy.wait()
        with create_engine(f"sqlite:///{workdir / 'spf' / 'cohort.db'}").connect() as conn:
            created = [r[0] for r in conn.execute(text("select created from requests order by created"))]
    e2e = sorted(v[2] for v in got)
    res = {"n": n, "wall_s": wall, "client_send_spread_s": max(v[0] for v in got) - min(v[0] for v in got),
           "created_spread_s": created[-1] - created[0], "gateway_cpu_s": g1 - g0, "worker_cpu_s": w1 - w0,
           "batcher_cpu_s": b1 - b0, "client_cpu_s": c1 - c0,
           "mean_ttft": sum(v[1] or 0.0 for v in got) / n, "e2e_mean": sum(e2e) / n, "e2e_p50": e2e[n // 2],
           "e2e_p90": e2e[int(n * 0.9)]}
    (out / "res.json").write_text(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), Path(sys.argv[2]), dict(a.split("=", 1) for a in sys.argv[3:])), indent=1))
