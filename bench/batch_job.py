"""`cohort bench batch-job`: a Batch API job on a real local stack, through failures,
and how it shares the stack with interactive traffic.

One fresh stack (its own redis-server with an append-only file, SQLite log DB; worker, batcher,
gateway and the job runner as processes; length emulation on, so every row generates exactly
its ``max_tokens``). Phases, each optional, run in this order:

- ``job``: the job through the Batch API, nothing else running: offline throughput (rows/s, tokens/s);
- ``interactive``: the job's rows sent as ordinary interactive requests, as many in flight as the
  runner keeps — the stack's throughput at saturation on this workload (the 1.0 of the ratio);
- ``probe``: a light interactive load alone (one request every ``probe_gap_s``): its p50 latency;
- ``job+probe``: the same job with the probe running: the probe's p50 while the job runs (the job
  yields: COHORT_OFFLINE__YIELD_OUTSTANDING rows in flight while interactive requests arrive);
- ``chaos``: the job again, with a worker SIGKILL, a job-runner SIGKILL and a gateway SIGKILL
  (each started again, as ``cohort serve`` does) at fractions of the job; ``--kills 0.5:redis``
  kills the redis-server instead (started again from its append-only file). Checked: every
  ``custom_id`` of the input is in the output or error file exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import func, select
from tqdm import tqdm

from bench.chaos import RedisServer
from cohort import jobdb
from cohort.apikeys import row_request_id
from cohort.logdb import requests
from procstack.stack import Stack, free_port

KEY = "sk-bench-batch"
PROMPTS = ("Summarise the news.", "Translate to French: good morning.", "Write a haiku about rain.",
           "List three prime numbers.", "Explain static batching in one sentence.", "Name a colour.")
PHASES = ("job", "interactive", "probe", "job+probe", "chaos")


def job_lines(rows: int, lo: int, hi: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [{"custom_id": f"row-{i}", "method": "POST", "url": "/v1/chat/completions",
             "body": {"messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                      "max_tokens": rng.randint(lo, hi), "ignore_eos": True}} for i in range(rows)]


class BenchStack:
    """The stack of one bench run, with the job runner."""

    def __init__(self, folder: Path, outstanding: int) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.redis = RedisServer(folder / "redis", appendonly=True)
        self.redis.start()
        self.port = free_port()
        url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "COHORT_REDIS_URL": self.redis.url, "COHORT_DATA_DIR": str(folder / "var"),
               "COHORT_DATABASE_URL": f"sqlite:///{folder / 'cohort.db'}", "COHORT_EMULATE_LENGTHS": "true",
               "COHORT_INSTANCE_TTL_S": "3", "COHORT_OFFLINE__POLL_S": "0.2", "COHORT_API_KEYS": KEY,
               "COHORT_OFFLINE__GATEWAY_URL": url, "COHORT_OFFLINE__MAX_OUTSTANDING": str(outstanding)}
        env.pop("COHORT_ADMIN_TOKEN", None)
        self.db_url = env["COHORT_DATABASE_URL"]
        self.stack = Stack(env, url, log_dir=folder / "logs")
        self.url = url

    def __enter__(self) -> BenchStack:
        self.stack.start_core("127.0.0.1", self.port)
        self.stack.spawn("batch-runner", "batch", "runner")
        self.stack.wait_healthy(600)
        return self

    def __exit__(self, *exc) -> None:
        self.stack.stop()
        self.redis.kill()

    def restart(self, name: str) -> None:
        """SIGKILL a process and start it again (what `cohort serve` does for a process that died);
        ``redis``: the redis-server, started again on its port from its append-only file."""
        if name == "redis":
            self.redis.kill()
            self.redis.start()
            return
        self.stack.kill(name)
        self.stack.restart(name)


def _p50(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 4) if xs else None


async def _chat(client: httpx.AsyncClient, body: dict) -> tuple[int, float, int]:
    t0 = time.monotonic()
    r = await client.post("/v1/chat/completions", json=body)
    tokens = r.json().get("usage", {}).get("completion_tokens", 0) if r.status_code == 200 else 0
    return r.status_code, time.monotonic() - t0, tokens


async def interactive(url: str, lines: list[dict], concurrency: int) -> dict[str, Any]:
    """The rows as interactive requests, ``concurrency`` in flight: throughput at saturation."""
    sem, tokens, ok = asyncio.Semaphore(concurrency), 0, 0
    bar = tqdm(total=len(lines), desc="interactive", unit="req")
    async with httpx.AsyncClient(base_url=url, timeout=900, headers={"authorization": f"Bearer {KEY}"}) as c:
        async def one(line: dict) -> None:
            nonlocal tokens, ok
            async with sem:
                status, _, n = await _chat(c, line["body"])
            ok, tokens = ok + (status == 200), tokens + n
            bar.update(1)

        t0 = time.monotonic()
        await asyncio.gather(*(one(x) for x in lines))
        wall = time.monotonic() - t0
    bar.close()
    return {"rows": len(lines), "answered": ok, "wall_s": round(wall, 2), "rows_per_s": round(ok / wall, 3),
            "tokens_per_s": round(tokens / wall, 1)}


async def probe(url: str, gap_s: float, stop: asyncio.Event) -> list[float]:
    """One short interactive request every ``gap_s`` until ``stop``: their latencies."""
    out: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=900, headers={"authorization": f"Bearer {KEY}"}) as c:
        tasks = []
        while not stop.is_set():
            body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 16, "ignore_eos": True}
            tasks.append(asyncio.create_task(_chat(c, body)))
            await asyncio.sleep(gap_s)
        for status, dt, _ in await asyncio.gather(*tasks):
            if status == 200:
                out.append(dt)
    return out


async def run_job(bs: BenchStack, lines: list[dict], events: dict[float, str] | None = None,
                  timeout_s: float = 3600) -> dict[str, Any]:
    """Upload, create, poll (SIGKILLs at the fractions ``events`` names), download and check."""
    events = dict(sorted((events or {}).items()))
    headers = {"authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=bs.url, timeout=60, headers=headers) as c:
        text = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = (await c.post("/v1/files", files={"file": ("job.jsonl", text)}, data={"purpose": "batch"})).json()
        b = (await c.post("/v1/batches", json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions",
                                               "completion_window": "24h"})).json()
        t0, done_events, bar = time.monotonic(), [], tqdm(total=len(lines), desc="batch job", unit="req")
        while time.monotonic() - t0 < timeout_s:
            try:
                b = (await c.get(f"/v1/batches/{b['id']}")).json()
            except httpx.HTTPError:  # the gateway is restarting
                await asyncio.sleep(0.5)
                continue
            n = b["request_counts"]["completed"] + b["request_counts"]["failed"]
            bar.update(n - bar.n)
            for frac in [k for k in events if n >= k * len(lines)]:
                name = events.pop(frac)
                done_events.append({"killed": name, "at_s": round(time.monotonic() - t0, 2), "rows_done": n})
                bar.write(f"SIGKILL {name} at {n} rows")
                await asyncio.to_thread(bs.restart, name)
            if b["status"] in ("completed", "failed", "expired", "cancelled"):
                break
            await asyncio.sleep(0.5)
        bar.close()
        wall = time.monotonic() - t0
        out = (await c.get(f"/v1/files/{b['output_file_id']}/content")).text if b.get("output_file_id") else ""
        err = (await c.get(f"/v1/files/{b['error_file_id']}/content")).text if b.get("error_file_id") else ""
    return _check(bs, b, lines, out, err, wall, done_events)


def _check(bs: BenchStack, b: dict, lines: list[dict], out: str, err: str, wall: float,
           events: list[dict]) -> dict[str, Any]:
    outs, errs = [json.loads(x) for x in out.splitlines()], [json.loads(x) for x in err.splitlines()]
    ids = [o["custom_id"] for o in outs + errs]
    expected = {x["custom_id"] for x in lines}
    tokens = sum(o["response"]["body"]["usage"]["completion_tokens"] for o in outs)
    db = jobdb.jobs_engine(bs.db_url)
    with db.connect() as conn:
        resent = conn.execute(select(func.count()).where(jobdb.batch_rows.c.batch_id == b["id"],
                                                         jobdb.batch_rows.c.attempts > 1)).scalar()
        # requests the gateway admitted for the job's rows (ids: cohort.apikeys.row_request_id):
        # beyond one per row, work done again; a row re-attached to its request adds none
        admitted = conn.execute(select(func.count()).where(
            requests.c.id.like(row_request_id(f"{b['id']}:", 0).removesuffix("-0") + "%"))).scalar()
    return {"status": b["status"], "rows": len(lines), "answered": len(outs), "errors": len(errs),
            "error_codes": sorted({(e["error"] or {}).get("code") or str(e["response"]["status_code"]) for e in errs}),
            "missing": len(expected - set(ids)), "duplicated": len(ids) - len(set(ids)),
            "unexpected": len(set(ids) - expected), "rows_sent_again": int(resent or 0),
            "requests_admitted": int(admitted or 0),
            "wall_s": round(wall, 2), "rows_per_s": round(len(outs) / wall, 3),
            "tokens_per_s": round(tokens / wall, 1), "kills": events}


def run_batch_bench(rows: int, workdir: Path, phases: list[str], outstanding: int, lo: int, hi: int, seed: int,
        kills: dict[float, str], probe_gap_s: float, probe_s: float,
        echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Every asked phase on one stack; the result (what ``--json`` writes)."""
    lines = job_lines(rows, lo, hi, seed)
    result: dict[str, Any] = {"config": {"rows": rows, "max_tokens": [lo, hi], "seed": seed, "outstanding": outstanding,
                                         "kills": {str(k): v for k, v in kills.items()}, "probe_gap_s": probe_gap_s,
                                         "phases": phases, "model": os.environ.get("COHORT_MODEL", "default"),
                                         "policy": os.environ.get("COHORT_POLICY", "magnus")}}

    async def main(bs: BenchStack) -> None:
        if "job" in phases:  # first: no interactive request has been seen yet, the job does not yield
            result["job"] = await run_job(bs, lines)
            echo(f"job alone: {result['job']}")
        if "interactive" in phases:
            result["interactive"] = await interactive(bs.url, lines, outstanding)
            echo(f"interactive: {result['interactive']}")
        if "probe" in phases:
            stop = asyncio.Event()
            task = asyncio.create_task(probe(bs.url, probe_gap_s, stop))
            await asyncio.sleep(probe_s)
            stop.set()
            lat = await task
            result["probe"] = {"requests": len(lat), "p50_s": _p50(lat)}
            echo(f"probe alone: {result['probe']}")
        if "job+probe" in phases:
            stop = asyncio.Event()
            task = asyncio.create_task(probe(bs.url, probe_gap_s, stop))
            job = await run_job(bs, lines)
            stop.set()
            lat = await task
            result["job+probe"] = {**job, "probe": {"requests": len(lat), "p50_s": _p50(lat)}}
            echo(f"job with the probe: {result['job+probe']}")
        if "chaos" in phases:
            result["chaos"] = await run_job(bs, lines, kills)
            echo(f"chaos: {result['chaos']}")

    with BenchStack(workdir / time.strftime("%Y%m%d-%H%M%S"), outstanding) as bs:
        asyncio.run(main(bs))
    base, alone, job = result.get("interactive"), result.get("job"), result.get("job+probe")
    if base and alone:
        result["offline_vs_interactive_throughput"] = round(alone["rows_per_s"] / base["rows_per_s"], 3)
    if result.get("probe", {}).get("p50_s") and job and job["probe"]["p50_s"]:
        result["probe_p50_with_job_vs_alone"] = round(job["probe"]["p50_s"] / result["probe"]["p50_s"], 3)
    return result
