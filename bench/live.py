"""Replay a workload against a running cohort stack over HTTP (``POST /v1/generate``).

Open loop: request i is sent at its Poisson arrival time whatever happened to the others (as
vLLM's benchmark client does), with ``emulated_tokens`` = its reference length so a random-weight
model generates exactly the trace's lengths (the server must run with
COHORT_EMULATE_LENGTHS=true). Bounded and self-stopping: at most ``max_in_flight`` requests
outstanding, every request has its own timeout, and the whole run stops at ``time_limit_s``
(requests not finished by then count as failed). Only loopback URLs are accepted — this is a
load generator and must never be pointed at someone else's server by accident.

Metrics are the simulator's (``bench.metrics.compute_metrics``): batch sizes come from the
responses' ``batch`` field (one entry per distinct batch id), WMA and padded tokens from the
members of each batch seen in the responses, with true lengths = generated tokens — except under
continuous execution (``padded_batches=False``), where a batch is an admission group whose rows
neither pad to nor wait for each other.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx
import numpy as np

from batcher.wma import total_wma
from bench.metrics import compute_metrics
from bench.workload import Workload

LOOPBACK = {"127.0.0.1", "localhost", "::1", "[::1]"}


def check_loopback(url: str) -> None:
    host = urlparse(url).hostname or ""
    if host not in LOOPBACK:
        raise ValueError(f"{url}: the live runner only talks to loopback hosts ({sorted(LOOPBACK)})")


@dataclass
class LiveResult:
    metrics: dict[str, float]
    wall_s: float
    errors: dict[str, int]
    batches: int
    texts: list[str | None] = field(default_factory=list)  # each request's answer (None: not answered)
    events: dict[str, int] = field(default_factory=dict)   # the server's counters over the run


EVENTS = ("oom_splits", "preemptions", "swaps")


def answer_digests(texts: Sequence[str | None]) -> list[str | None]:
    """Each answer as a short digest: what the results JSON keeps to compare runs (also runs
    merged in from another invocation, ``--merge``) without storing the texts."""
    return [None if t is None else hashlib.sha1(t.encode()).hexdigest()[:16] for t in texts]


def compare_answers(texts: Mapping[str, Sequence[str | None]]) -> dict[str, Any]:
    """Answers (or their digests) of the same requests across runs: temperature 0 is greedy, so
    the same workload must give the same text whatever evicted what. How many requests every run
    answered, how many of those are identical everywhere, and the indices of the first that differ."""
    runs = list(texts.values())
    both = [i for i in range(min(map(len, runs), default=0)) if all(r[i] is not None for r in runs)]
    differ = [i for i in both if len({r[i] for r in runs}) > 1]
    return {"runs": list(texts), "compared": len(both), "identical": len(both) - len(differ),
            "differ": differ[:20]}


async def run_live(workload: Workload, url: str, *, padded_batches: bool = True, max_in_flight: int = 256,
                   request_timeout_s: float = 300.0,
                   time_limit_s: float = 600.0, transport: httpx.AsyncBaseTransport | None = None,
                   progress: Callable[[int], None] | None = None) -> LiveResult:
    """Send every request of ``workload`` at its arrival time; return the benchmark metrics."""
    if transport is None:
        check_loopback(url)
    n = len(workload)
    recs = workload.rows.records
    sent = np.full(n, math.nan)
    finish = np.full(n, math.inf)
    ok = np.zeros(n, dtype=bool)
    gen = np.zeros(n, dtype=np.int64)
    first = np.full(n, math.nan)
    scheduled = np.full(n, math.nan)   # sent + the server's queued_s: first dispatch (weighted turnaround)
    batch_of: list[tuple[str, int] | None] = [None] * n
    texts: list[str | None] = [None] * n
    errors: dict[str, int] = defaultdict(int)
    sem = asyncio.Semaphore(max_in_flight)
    t0 = time.perf_counter()

    async def one(client: httpx.AsyncClient, i: int) -> None:
        delay = float(workload.arrival[i]) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        async with sem:
            r = recs[int(workload.row[i])]
            body = {"instruction": r.instruction, "input": r.input, "max_tokens": workload.config.max_tokens,
                    "slo_seconds": float(workload.slo_s[i]), "emulated_tokens": int(workload.true_tokens[i]),
                    "task": r.task}
            sent[i] = time.perf_counter() - t0
            try:
                resp = await client.post("/v1/generate", json=body, timeout=request_timeout_s)
            except httpx.HTTPError as e:
                errors[type(e).__name__] += 1
                return
            finally:
                if progress:
                    progress(1)
            if resp.status_code != 200:
                errors[f"http_{resp.status_code}"] += 1
                return
            d = resp.json()
            finish[i] = time.perf_counter() - t0
            ok[i] = True
            gen[i] = int(d.get("generated_tokens", 0))
            texts[i] = d.get("text")
            ttft = (d.get("timings") or {}).get("first_token_s")
            first[i] = sent[i] + float(ttft) if ttft is not None else finish[i]
            queued = (d.get("timings") or {}).get("queued_s")
            scheduled[i] = sent[i] + float(queued) if queued is not None else sent[i]
            b = d.get("batch") or {}
            batch_of[i] = (str(b.get("id")), int(b.get("size", 1)))

    limits = httpx.Limits(max_connections=max_in_flight, max_keepalive_connections=max_in_flight)
    async with httpx.AsyncClient(base_url=url, limits=limits, transport=transport) as client:
        before = await server_events(client)
        tasks = [asyncio.create_task(one(client, i)) for i in range(n)]
        done, pending = await asyncio.wait(tasks, timeout=time_limit_s)
        for t in pending:
            t.cancel()
        if pending:
            errors["time_limit"] += len(pending)
            await asyncio.gather(*pending, return_exceptions=True)
        after = await server_events(client)
    wall = time.perf_counter() - t0

    # arrival = when we actually sent it (open loop lag shows up as latency otherwise)
    arrival = np.where(np.isnan(sent), workload.arrival, sent)
    deadline = arrival + workload.slo_s
    members: dict[str, list[int]] = defaultdict(list)
    sizes: dict[str, int] = {}
    for i, bs in enumerate(batch_of):
        if bs is not None:
            members[bs[0]].append(i)
            sizes[bs[0]] = bs[1]
    padded, wma = 0.0, 0
    for bid, idx in members.items():
        if not padded_batches:  # continuous: rows neither wait for nor pad to the others of their batch
            padded += float(gen[idx].sum())
            continue
        g_b = int(gen[idx].max())
        padded += sizes[bid] * g_b
        wma += total_wma([(int(workload.input_tokens[i]), int(gen[i])) for i in idx])
    true = np.where(ok, gen, workload.true_tokens)
    events = {k: after.get(k, 0) - before.get(k, 0) for k in EVENTS}
    metrics = compute_metrics(arrival, finish, ok, deadline, true, list(sizes.values()), padded, wma,
                              events["oom_splits"], first_token=first, preemptions=events["preemptions"],
                              scheduled=scheduled)
    return LiveResult(metrics, wall, dict(errors), len(sizes), texts, events)


async def server_events(client: httpx.AsyncClient) -> dict[str, int]:
    """The server's own batcher counters (``cohort_batcher_events{event=...}`` on /metrics: OOM
    splits, preemptions, …); empty if it has none."""
    try:
        text = (await client.get("/metrics", timeout=10)).text
    except httpx.HTTPError:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("cohort_batcher_events{event="):
            name = line.split('"')[1]
            out[name] = int(float(line.split()[-1]))
    return out


def run_live_sync(workload: Workload, url: str, **kw: Any) -> LiveResult:
    return asyncio.run(run_live(workload, url, **kw))
