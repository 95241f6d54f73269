"""A fleet in a box: N simulated vLLM engines (``cohort engine-sim serve``), reached directly by a
client that routes each request itself (round-robin or least-loaded) or through cohort in front
of all of them (``COHORT_UPSTREAMS``), the same seeded workload each way.

Time: the engines run ``speedup`` times faster than wall time (below 1: slower, which is how a
2-core box holds a fleet's traffic). Workloads are drawn in *model* seconds; the replay sends
request i at ``arrival[i] / speedup`` wall seconds and every measured time is multiplied back by
``speedup``, so every number reported is model time, comparable across speedups.

Pure parts (unit-tested without processes): ``Router`` (the direct client's choice of engine),
``to_wall`` / ``to_model`` (the time scaling), ``summary`` (``upstream_bench.summarize`` plus
percentiles), ``parse_metrics`` / ``engine_totals`` (an engine's ``/metrics``), ``ratios_to`` and
``check_targets``.
"""

from __future__ import annotations

import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

from bench.fleet_bound import BOUNDED_METRICS
from bench.live import check_loopback
from bench.upstream_bench import StreamResult, _one, direct_body, summarize
from bench.workload import Workload
from cohort.tokenizer import build_prompt
from procstack.stack import free_port, wait_until_ok

ROUTES = ("rr", "ll")
ENGINE_POLICIES = {"fcfs": "fcfs", "prio": "priority"}
BASE = "rr-fcfs"   # every ratio is to the round-robin client in front of FCFS engines (vLLM's default)
SOLO = "solo-bound"  # every request alone on an engine (``bench.fleet_bound``): what no target can beat


def direct_target(name: str) -> tuple[str, str] | None:
    """``rr-fcfs`` → ("rr", "fcfs"): a direct client's route and its engines' scheduling policy
    (``prio``: started with ``--scheduling-policy priority``, unused by the client); None for a
    cohort policy name."""
    route, _, pol = name.partition("#")[0].partition("-")
    if route in ROUTES and pol in ENGINE_POLICIES:
        return route, ENGINE_POLICIES[pol]
    return None


class Router:
    """The direct client's choice of engine for each request. ``rr``: in turn. ``ll``: the engine
    with the fewest of this client's requests in flight, ties broken in round-robin order (so an
    idle fleet is filled evenly)."""

    def __init__(self, route: str, n: int) -> None:
        if route not in ROUTES or n < 1:
            raise ValueError(f"route must be one of {ROUTES} over at least one engine")
        self.route, self.n = route, n
        self.in_flight = [0] * n
        self._next = 0

    def pick(self) -> int:
        if self.route == "rr":
            k = self._next
        else:
            k = min(range(self.n), key=lambda j: (self.in_flight[j], (j - self._next) % self.n))
        self._next = (k + 1) % self.n
        self.in_flight[k] += 1
        return k

    def done(self, k: int) -> None:
        self.in_flight[k] -= 1


def to_wall(workload: Workload, speedup: float) -> Workload:
    """The workload with its arrivals in wall seconds (model seconds / speedup)."""
    return replace(workload, arrival=np.asarray(workload.arrival, dtype=float) / speedup)


def to_model(res: StreamResult, speedup: float) -> StreamResult:
    """A run's wall-second times as model seconds (× speedup)."""
    return replace(res, sent=res.sent * speedup, first=res.first * speedup, done=res.done * speedup,
                   itl_sum=res.itl_sum * speedup, wall_s=res.wall_s * speedup)


def _q(x: np.ndarray, p: float) -> float:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, p)) if len(x) else math.nan


def saturated_rps(res: StreamResult, lo: float = 0.1, hi: float = 0.9) -> float:
    """Requests done per second between the ``lo`` and ``hi`` quantiles of the done times: the rate
    of a fleet kept full, without the ramp of the first arrivals and the drain of the last long
    requests. A burst's done/span counts both: 200 requests on four KV-bound engines measured 38.1
    model req/s that way, where the fleet completes 46.2 when full, so 0.9 of it left the fleet
    lightly queued (docs/notes/fleet.md)."""
    done = np.sort(res.done[res.ok])
    if len(done) < 10:
        return math.nan
    i, j = int(lo * (len(done) - 1)), int(hi * (len(done) - 1))
    span = float(done[j] - done[i])
    return (j - i) / span if span > 0 else math.nan


def summary(workload: Workload, res: StreamResult) -> dict[str, Any]:
    """``summarize`` (throughput, goodput = TTFT ≤ 1 s and e2e ≤ SLO, means) with TTFT, ITL and e2e
    p50/p90/p99 and the saturated rate; ``workload`` and ``res`` in the same (model) time."""
    out = summarize(workload, res)
    out["saturated_rps"] = saturated_rps(res)
    ok = res.ok
    cols = {"latency": (res.done - res.sent)[ok], "ttft": (res.first - res.sent)[ok],
            "itl": res.itl_sum[ok] / np.maximum(res.tokens[ok] - 1, 1)}
    for name, x in cols.items():
        for p in (50, 90, 99):
            out[f"p{p}_{name}_s"] = _q(x, p)
    return out


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text → {metric name: value summed over its label sets} (histograms' series too)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        name = head.partition("{")[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return out


# A run kept the model clock when at most this share of its engines' steps started late (over
# 20 ms of wall time behind their schedule): the box then held that fleet at that speedup.
HELD_LATE_SHARE = 0.01
ENGINE_KEYS = {"preemptions": "vllm:num_preemptions_total", "prefix_queries": "vllm:prefix_cache_queries_total",
               "prefix_hits": "vllm:prefix_cache_hits_total", "generation_tokens": "vllm:generation_tokens_total",
               "prompt_tokens": "vllm:prompt_tokens_total", "finished": "vllm:request_success_total",
               "aborted": "engine_sim_requests_aborted_total", "steps": "engine_sim_steps_total",
               "late_steps": "engine_sim_late_steps_total"}


def engine_totals(per_engine: Sequence[dict[str, float]]) -> dict[str, Any]:
    """The fleet's vLLM counters: each engine's, their sums and the prefix-cache hit rate."""
    rows = [{k: m.get(v, 0.0) for k, v in ENGINE_KEYS.items()} for m in per_engine]
    tot = {k: sum(r[k] for r in rows) for k in ENGINE_KEYS}
    tot["prefix_hit_rate"] = tot["prefix_hits"] / tot["prefix_queries"] if tot["prefix_queries"] else 0.0
    tot["late_step_share"] = tot["late_steps"] / tot["steps"] if tot["steps"] else 0.0
    tot["per_engine"] = rows
    return tot


def scrape(urls: Sequence[str]) -> dict[str, Any]:
    """Every engine's ``/metrics`` (base URLs ending in /v1), as ``engine_totals``."""
    return engine_totals([parse_metrics(httpx.get(f"{u.removesuffix('/v1')}/metrics", timeout=10).text)
                          for u in urls])


def ratios_to(runs: dict[str, dict[str, Any]], base: str, keys: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """Each run's ``keys`` over the base run's (None where the base is 0 or missing)."""
    b = runs.get(base)
    return {t: {k: (float(m[k]) / float(b[k]) if b and b.get(k) else None) for k in keys} for t, m in runs.items()}


# The product's targets for cohort against rr-fcfs: (metric, ratio bound, True: at most / False: at least)
TARGETS = {"magnus": (("mean_latency_s", 0.7, True), ("p50_latency_s", 0.5, True), ("p99_latency_s", 1.2, True),
                      ("goodput_rps", 1.3, False), ("throughput_rps", 0.97, False)),
           "chat": (("prefix_hit_rate", 2.0, False), ("mean_ttft_s", 0.5, True))}


def check_targets(runs: dict[str, dict[str, Any]], target: str, workload: str, base: str = BASE
                  ) -> list[dict[str, Any]]:
    """Each of ``workload``'s targets for run ``target`` against ``base``: the ratio, whether met and,
    where the runs hold the solo bound (``SOLO``), the best ratio any target could reach and whether
    the target is reachable at all."""
    out = []
    r = ratios_to(runs, base, [k for k, _, _ in TARGETS.get(workload, ())])
    for key, bound, at_most in TARGETS.get(workload, ()):
        v = r.get(target, {}).get(key)
        met = v is not None and (v <= bound if at_most else v >= bound)
        c = {"metric": key, "ratio": v, "bound": f"{'<=' if at_most else '>='} {bound}", "met": met}
        best = r.get(SOLO, {}).get(key) if key in BOUNDED_METRICS else None
        if best is not None:
            c["best_possible"] = best
            c["reachable"] = best <= bound if at_most else best >= bound
        out.append(c)
    return out


def spread(values: Sequence[float]) -> float:
    """(max − min) / mean of repeated runs' values: how far apart the repeats are."""
    v = [x for x in values if x is not None and not math.isnan(x)]
    return (max(v) - min(v)) / (sum(v) / len(v)) if v and sum(v) else 0.0


# --- the engines -------------------------------------------------------------------------------
@dataclass
class EngineSpec:
    """How every engine of the fleet is started (``cohort engine-sim serve`` options)."""

    gpu: str = "h100-80gb"
    model: str = "llama-3-8b"
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 256
    max_model_len: int | None = None
    speedup: float = 1.0
    model_name: str = "sim-llama"
    extra: list[str] = field(default_factory=list)

    def args(self, port: int, policy: str, more: Sequence[str] = ()) -> list[str]:
        a = [sys.executable, "-m", "bench.engine_sim.cli", "serve", "--port", str(port), "--model-name",
             self.model_name, "--gpu", self.gpu, "--model", self.model, "--max-num-seqs", str(self.max_num_seqs),
             "--scheduling-policy", policy, "--speedup", f"{self.speedup:g}", "--log-level", "WARNING"]
        if self.num_gpu_blocks:
            a += ["--num-gpu-blocks", str(self.num_gpu_blocks)]
        if self.max_model_len:
            a += ["--max-model-len", str(self.max_model_len)]
        return [*a, *self.extra, *more]


@contextmanager
def engine_fleet(n: int, spec: EngineSpec, policy: str, workdir: Path, timeout_s: float = 60.0,
                 per_engine: Sequence[Sequence[str]] = ()) -> Iterator[list[str]]:
    """Start ``n`` engines (``per_engine[i]``: more options for engine i); yield their base URLs
    (…/v1); stop every one on the way out."""
    workdir.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    urls: list[str] = []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    try:
        for i in range(n):
            port = free_port()
            more = per_engine[i] if i < len(per_engine) else ()
            with open(workdir / f"engine-{i}.log", "ab") as log:
                procs.append(subprocess.Popen(spec.args(port, policy, more), stdout=log, stderr=subprocess.STDOUT,
                                              env=env))
            urls.append(f"http://127.0.0.1:{port}/v1")
        for i, (p, u) in enumerate(zip(procs, urls, strict=True)):
            def alive(p: subprocess.Popen = p, i: int = i) -> None:
                if p.poll() is not None:
                    raise RuntimeError(f"engine {i} exited {p.returncode}: "
                                       f"{(workdir / f'engine-{i}.log').read_text()[-2000:]}")
            if not wait_until_ok(f"{u.removesuffix('/v1')}/health", timeout_s, alive):
                raise TimeoutError(f"engine {i} at {u} not healthy after {timeout_s:g} s")
        yield urls
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# --- the replay --------------------------------------------------------------------------------
def fleet_direct_body(workload: Workload, model: str, stream_interval: int = 8) -> Callable[[int, str], dict]:
    """An engine direct (``direct_body``: the true length with ignore_eos), its tokens streamed in
    chunks of ``stream_interval`` as cohort asks its upstreams (the first token and the end at
    once): the client's own CPU then stays out of the measurement at fleet rates."""
    base = direct_body(workload, model)

    def body(i: int, prompt: str) -> dict[str, Any]:
        return {**base(i, prompt), "stream_interval": stream_interval}
    return body


def fleet_cohort_body(workload: Workload, model: str, speedup: float) -> Callable[[int, str], dict]:
    """cohort in front (``upstream_bench.cohort_body``) with each SLO in wall seconds (model / speedup)."""
    def body(i: int, prompt: str) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": workload.config.max_tokens,
                "emulated_tokens": int(max(1, workload.true_tokens[i])),
                "slo_seconds": float(workload.slo_s[i]) / speedup, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
    return body


async def replay_routed(workload: Workload, base_urls: Sequence[str], body_of: Callable[[int, str], dict],
                        route: str = "rr", *, timeout_s: float = 600.0,
                        progress: Callable[[int], None] | None = None) -> tuple[StreamResult, list[int]]:
    """``upstream_bench.replay_streams`` over several engines: request i goes, at its (wall) arrival,
    to the engine the ``Router`` picks then. Returns the result and each request's engine."""
    for u in base_urls:
        check_loopback(u)
    n = len(workload)
    nan = np.full(n, math.nan)
    res = StreamResult(nan.copy(), nan.copy(), nan.copy(), np.zeros(n, dtype=np.int64), np.zeros(n),
                       np.zeros(n, dtype=bool), 0.0, {})
    router = Router(route, len(base_urls))
    where = [-1] * n
    recs = workload.rows.records
    urls = [f"{u.rstrip('/')}/completions" for u in base_urls]
    connector = aiohttp.TCPConnector(limit=4096, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    t0 = time.perf_counter()

    async def send(session: aiohttp.ClientSession, i: int) -> None:
        delay = float(workload.arrival[i]) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        r = recs[int(workload.row[i])]
        k = where[i] = router.pick()
        try:
            await _one(session, urls[k], body_of(i, build_prompt(r.instruction, r.input)), i, res, t0, timeout)
        finally:
            router.done(k)
        if progress:
            progress(1)

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(send(session, i) for i in range(n)))
    res.wall_s = time.perf_counter() - t0
    return res, where
