"""The upstream benchmark's driver: one seeded workload replayed as streaming OpenAI completions,
straight to an engine (vLLM, any OpenAI-compatible server) or to cohort in front of it, measured
the same way at the client for both — TTFT, inter-token latency, e2e latency, goodput.

The prompts are the ones cohort builds (``cohort.tokenizer.build_prompt``), sent as text both ways;
the engine tokenizes direct's, cohort tokenizes its own (``cohort.tokenizer.prompt_token_ids``), so
the tokens match except where cohort leaves out special tokens (its built-in tiny model only: the
engine then runs [CLS]…[SEP] around the same prompt, two tokens more). The engine direct gets ``max_tokens`` = the true length with ``ignore_eos``; cohort
gets the workload's ``max_tokens`` as the client's bound and the true length as
``emulated_tokens`` — its predictor must find the length from the prompt, as in production.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import numpy as np

from bench.live import check_loopback
from bench.workload import Workload
from cohort.tokenizer import build_prompt

TTFT_GOAL_S = 1.0  # goodput: a request that met TTFT <= 1 s and e2e <= its slo_seconds


@dataclass
class StreamResult:
    """Per-request arrays of one run (seconds from the run's start; nan where not reached)."""

    sent: np.ndarray
    first: np.ndarray
    done: np.ndarray
    tokens: np.ndarray
    itl_sum: np.ndarray
    ok: np.ndarray
    wall_s: float
    errors: dict[str, int]


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], i: int, res: StreamResult,
               t0: float, timeout: aiohttp.ClientTimeout) -> None:
    res.sent[i] = time.perf_counter() - t0
    last = None
    try:
        async with session.post(url, json=body, timeout=timeout) as r:
            if r.status != 200:
                await r.read()
                res.errors[f"http_{r.status}"] = res.errors.get(f"http_{r.status}", 0) + 1
                return
            async for line in r.content:
                if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                    continue
                d = json.loads(line[5:])
                if d.get("choices"):  # a token's chunk even where its text is "" (a special token,
                    # or bytes of a character not yet whole): counting only chunks with text put a
                    # row's first token as late as its end where the model emits such tokens
                    now = time.perf_counter() - t0
                    if last is None:
                        res.first[i] = now
                    else:
                        res.itl_sum[i] += now - last
                    last = now
                usage = d.get("usage")
                if usage:
                    res.tokens[i] = usage.get("completion_tokens", 0)
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as e:
        res.errors[type(e).__name__] = res.errors.get(type(e).__name__, 0) + 1
        return
    res.done[i] = time.perf_counter() - t0
    res.ok[i] = True
    if math.isnan(res.first[i]):  # a stream without a single choice chunk:
        res.first[i] = res.done[i]  # its first token reached the client with the end


async def replay_streams(workload: Workload, base_url: str, body_of: Callable[[int, str], dict[str, Any]], *,
                 max_in_flight: int = 1024, timeout_s: float = 600.0,
                 progress: Callable[[int], None] | None = None) -> StreamResult:
    """Send request i at its arrival time as ``body_of(i, prompt)``, streamed."""
    check_loopback(base_url)
    n = len(workload)
    nan = np.full(n, math.nan)
    res = StreamResult(nan.copy(), nan.copy(), nan.copy(), np.zeros(n, dtype=np.int64), np.zeros(n),
                       np.zeros(n, dtype=bool), 0.0, {})
    recs = workload.rows.records
    # aiohttp, not httpx: the client shares a core with cohort's processes in the recipe, and httpx
    # spent ~3x the CPU per stream (measured in docs/notes/upstream.md), which a cohort run paid and a
    # direct one did not. Idle connections expire before the servers' own 5 s keep-alive
    # (uvicorn's, vLLM's): a request sent on a connection the server is closing that instant dies
    # with a disconnect, never received.
    connector = aiohttp.TCPConnector(limit=max_in_flight, keepalive_timeout=2.0)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    url = f"{base_url.rstrip('/')}/completions"
    t0 = time.perf_counter()
    sem = asyncio.Semaphore(max_in_flight)

    async def send(session: aiohttp.ClientSession, i: int) -> None:
        delay = float(workload.arrival[i]) - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        r = recs[int(workload.row[i])]
        async with sem:
            await _one(session, url, body_of(i, build_prompt(r.instruction, r.input)), i, res, t0, timeout)
        if progress:
            progress(1)

    async with aiohttp.ClientSession(connector=connector) as session:
        await asyncio.gather(*(send(session, i) for i in range(n)))
    res.wall_s = time.perf_counter() - t0
    return res


def summarize(workload: Workload, res: StreamResult) -> dict[str, Any]:
    """Throughput, latency percentiles, TTFT, ITL and goodput of one run."""
    ok = res.ok
    e2e = (res.done - res.sent)[ok]
    ttft = (res.first - res.sent)[ok]
    steps = np.maximum(res.tokens[ok] - 1, 1)
    itl = res.itl_sum[ok] / steps
    span = float(np.nanmax(res.done)) if ok.any() else res.wall_s
    good = ok & ((res.first - res.sent) <= TTFT_GOAL_S) & ((res.done - res.sent) <= workload.slo_s)

    def q(x: np.ndarray, p: float) -> float:
        x = x[~np.isnan(x)]
        return float(np.percentile(x, p)) if len(x) else math.nan

    def mean(x: np.ndarray) -> float:
        x = x[~np.isnan(x)]
        return float(x.mean()) if len(x) else math.nan

    return {"requests": len(ok), "done": int(ok.sum()), "lost": int((~ok).sum()), "errors": res.errors,
            "throughput_rps": float(ok.sum() / span) if span > 0 else 0.0,
            "tokens_per_s": float(res.tokens[ok].sum() / span) if span > 0 else 0.0,
            "mean_latency_s": mean(e2e), "p50_latency_s": q(e2e, 50),
            "p99_latency_s": q(e2e, 99), "mean_ttft_s": mean(ttft),
            "p50_ttft_s": q(ttft, 50), "mean_itl_s": mean(itl),
            "goodput_rps": float(good.sum() / span) if span > 0 else 0.0, "wall_s": res.wall_s}


def per_request(res: StreamResult) -> dict[str, list[float | None]]:
    """Each request's times (s from the run's start; None where not reached) and tokens, for paired
    comparisons: every target replays the same workload, so request i is the same prompt in each."""
    def col(x: np.ndarray) -> list[float | None]:
        return [None if math.isnan(v) else round(float(v), 5) for v in x]
    return {"sent": col(res.sent), "first": col(res.first), "done": col(res.done),
            "tokens": [int(t) for t in res.tokens]}


def served_model(base_url: str) -> str:
    """The first model id an OpenAI-compatible server lists (``GET /models``)."""
    return httpx.get(f"{base_url}/models", timeout=30).json()["data"][0]["id"]


def direct_body(workload: Workload, model: str) -> Callable[[int, str], dict[str, Any]]:
    """The engine direct: the true length as max_tokens with ignore_eos (its own FCFS order)."""
    def body(i: int, prompt: str) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": int(max(1, workload.true_tokens[i])),
                "ignore_eos": True, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return body


def cohort_body(workload: Workload, model: str) -> Callable[[int, str], dict[str, Any]]:
    """cohort in front: the client's bound as max_tokens, the true length emulated, the SLO given."""
    def body(i: int, prompt: str) -> dict[str, Any]:
        return {"model": model, "prompt": prompt, "max_tokens": workload.config.max_tokens,
                "emulated_tokens": int(max(1, workload.true_tokens[i])), "slo_seconds": float(workload.slo_s[i]),
                "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    return body
