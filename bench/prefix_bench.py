"""Prefix caching measured: the chat-prefix workload (``bench.chat_prefix``) with and without the
cache, in the simulator and live, side by side on one seeded trace.

Simulator (``prefix_sim``): cohort's policy under continuous execution on N instances, each
instance the worker's running set (``bench.group_engine``), three ways — no cache; a cache per
instance with groups going to whichever instance has room (least-loaded routing); and a cache with
prefix-aware routing (an instance with room takes, of the next few groups in the policy's order,
the one whose prompt it holds the longest prefix of). vLLM's scheduler (``cb-fcfs``, no cache in
the simulator) is the reference row.

Live (``prefix_live``): a spawned stack per setting (``COHORT_PREFIX_CACHING`` on and off) on the
built-in engine, each measured for capacity by a burst, then replayed at one offered rate (a share
of the cache-off capacity) with streamed completions (TTFT from the first chunk); optionally an
OpenAI-compatible engine direct (vLLM with its own prefix caching) at a share of its own capacity.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
from tqdm import tqdm

from batcher.memory import KVMemory
from bench.chat_prefix import ChatPrefixConfig, ChatPrefixWorkload, make_chat_prefix_workload, prefix_stats
from bench.continuous_run import DEFAULT_GROUP_FRAC
from bench.live_stack import spawned_stack
from bench.roofline import RooflineBatchTime, instance
from bench.simulator import simulate
from bench.upstream_bench import cohort_body, direct_body, replay_streams, served_model, summarize
from predictor.estimator import AnalyticBatchTime

SIM_KEYS = ("request_throughput", "mean_latency_s", "p99_latency_s", "mean_ttft_s", "p99_ttft_s", "prefix_hit_rate",
            "completed", "failed", "preemptions")


def sim_runs(policy: str, affinity: int) -> list[tuple[str, str, bool, int]]:
    """(label, policy, prefix caching, routing window) of each simulated setting."""
    return [("cb-fcfs", "cb-fcfs", False, 0), (f"{policy} no cache", policy, False, 0),
            (f"{policy} cache, least-loaded", policy, True, 0), (f"{policy} cache, prefix-aware", policy, True, affinity)]


def prefix_sim(cfg: ChatPrefixConfig, *, policy: str = "spf", instances: int = 4, gpu: str = "a800-80gb",
               model: str = "llama-13b", kv_tokens: int | None = None, affinity: int = 32,
               at_capacity: float | None = None, progress: Callable[[str], None] | None = None,
               group_frac: float = DEFAULT_GROUP_FRAC, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every setting of ``sim_runs`` on one trace; ``kv_tokens``: each instance's KV (default the
    preset's Θ), small enough that caches cannot hold every conversation is where routing matters.

    ``at_capacity``: first measure least-loaded routing's capacity (its throughput on the trace at
    ``cfg.rate``, which must overload it), then run every setting on the trace offered at this share
    of that capacity. At ``cfg.rate`` far above capacity a run is one long drain, whose mean TTFT is
    half the drain whatever the order; at least-loaded's own capacity (1.0) the baseline is exactly
    saturated and a faster setting shows its TTFT with a queue that stays bounded.

    ``group_frac``: the share of Θ a group is planned with (the built-in engine's by default; an
    upstream pool's is larger); ``params``: the policy's settings (``spf_prefix_window``...)."""
    inst = instance(gpu, model)
    tm = inst.time_model()
    memory = inst.memory if kv_tokens is None else KVMemory(inst.memory.delta_bytes, kv_tokens * inst.memory.delta_bytes)
    settings = sim_runs(policy, affinity)
    probe: dict[str, Any] | None = None
    if at_capacity:
        label, pol, caching, window = settings[2]   # cache, least-loaded
        m = _sim_one(make_chat_prefix_workload(cfg, tm), cfg, pol, memory, tm, instances, caching, window,
                     group_frac, params)
        probe = {"setting": label, "offered_rps": cfg.rate, "capacity_rps": m["request_throughput"],
                 "share": at_capacity}
        if progress:
            progress(f"{label} capacity at {cfg.rate:g} req/s offered: {m['request_throughput']:.2f} req/s")
        cfg = replace(cfg, rate=at_capacity * m["request_throughput"])
    wl = make_chat_prefix_workload(cfg, tm)
    runs: dict[str, dict[str, Any]] = {}
    for label, pol, caching, window in settings:
        runs[label] = _sim_one(wl, cfg, pol, memory, tm, instances, caching, window, group_frac, params)
        if progress:
            m = runs[label]
            progress(f"{label}: {m['request_throughput']:.2f} req/s, mean TTFT {m['mean_ttft_s']:.3f} s, "
                     f"hit rate {m['prefix_hit_rate']:.3f}")
    return {"config": {"runner": "sim", "workload": cfg.to_dict(), "instances": instances, "gpu": gpu,
                       "model": model, "kv_tokens": memory.theta_tokens, "policy": policy, "affinity": affinity,
                       "group_frac": group_frac, "params": params or {},
                       "capacity_probe": probe, "trace": prefix_stats(wl)}, "runs": runs}


def _sim_one(wl: ChatPrefixWorkload, cfg: ChatPrefixConfig, policy: str, memory: KVMemory, tm: RooflineBatchTime,
             instances: int, caching: bool, window: int, group_frac: float = DEFAULT_GROUP_FRAC,
             params: dict[str, Any] | None = None) -> dict[str, Any]:
    """One simulated setting on ``wl``: its ``SIM_KEYS``."""
    res = simulate(wl.requests(oracle=True), policy, memory, tm, instances=instances, execution="continuous",
                   oom_recovery="preempt", max_input_tokens=int(wl.input_tokens.max()),
                   max_tokens_limit=cfg.max_tokens, prefix_caching=caching, prefix_affinity=window,
                   group_frac=group_frac, params=params)
    return {k: res.metrics.get(k, 0.0) for k in SIM_KEYS}


def _replay(wl: ChatPrefixWorkload, url: str, body: Callable, label: str) -> dict[str, Any]:
    with tqdm(total=len(wl), desc=label, unit="req") as bar:
        return summarize(wl, asyncio.run(replay_streams(wl, url, body, progress=bar.update)))


def _at_rate(cfg: ChatPrefixConfig, rate: float) -> ChatPrefixWorkload:
    return make_chat_prefix_workload(replace(cfg, rate=rate), AnalyticBatchTime())


def _scrape_hits(url: str) -> dict[str, float]:
    """The stack's prefix-cache counters (``cohort_prefix_cache_*_total``, summed over instances)
    and its evictions (rows preempted for pages)."""
    out = {"queries": 0.0, "hits": 0.0, "evictions": 0.0}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        for k in ("queries", "hits"):
            if line.startswith(f"cohort_prefix_cache_{k}_total{{"):
                out[k] += float(line.rsplit(" ", 1)[1])
        if line.startswith('cohort_batcher_events{event="preemptions"}'):
            out["evictions"] = float(line.rsplit(" ", 1)[1])
    return out


def _replay_counted(wl: ChatPrefixWorkload, url: str, served: str, label: str) -> dict[str, Any]:
    """Replay ``wl`` on a cohort stack, with the prefix-cache hit rate and evictions of that run alone
    (the stack's counters before and after)."""
    before = _scrape_hits(url)
    run = _replay(wl, f"{url}/v1", cohort_body(wl, served), label)
    after = _scrape_hits(url)
    q = after["queries"] - before["queries"]
    run["prefix_hit_rate"] = (after["hits"] - before["hits"]) / q if q else 0.0
    run["evictions"] = after["evictions"] - before["evictions"]
    return run


def prefix_live(cfg: ChatPrefixConfig, *, policy: str = "spf", load: float = 0.8, env: dict[str, str] | None = None,
                workdir: Path = Path("var/bench/prefix"), engine: str | None = None, engine_load: float = 0.5,
                burst_s: float = 1.5, capacity: dict[str, float] | None = None) -> dict[str, Any]:
    """Capacity of each setting (a burst of the whole trace within ``burst_s``, unless given), then
    the trace at ``load`` × the cache-off capacity on both; ``engine``: an OpenAI-compatible server
    direct (its own caching) at ``engine_load`` × its capacity, and cohort (cache on) at the same
    share of its own."""
    capacity = dict(capacity or {})
    runs: dict[str, dict[str, Any]] = {}
    stacks = {"no cache": "false", "cache": "true"}
    burst = _at_rate(cfg, cfg.requests / burst_s)
    offered: dict[str, float] = {}
    for label, flag in stacks.items():
        with spawned_stack(policy, {**(env or {}), "COHORT_PREFIX_CACHING": flag},
                           workdir / label.replace(" ", "-")) as url:
            served = served_model(f"{url}/v1")
            if label not in capacity:
                capacity[label] = _replay(burst, f"{url}/v1", cohort_body(burst, served),
                                          f"{label}: capacity")["throughput_rps"]
            rates = {f"{label} @ {load:g}x no-cache capacity": load * capacity.get("no cache", capacity[label])}
            if engine and label == "cache":
                rates[f"{label} @ {engine_load:g}x own capacity"] = engine_load * capacity[label]
            for run_label, rate in rates.items():
                wl = _at_rate(cfg, rate)
                runs[run_label] = _replay_counted(wl, url, served, run_label)
                runs[run_label]["trace_page_hit_fraction"] = prefix_stats(wl)["page_hit_fraction"]
                offered[run_label] = rate
    if engine:
        model = served_model(engine)
        if "engine" not in capacity:
            capacity["engine"] = _replay(burst, engine, direct_body(burst, model), "engine: capacity")["throughput_rps"]
        label = f"engine direct @ {engine_load:g}x own capacity"
        wl = _at_rate(cfg, engine_load * capacity["engine"])
        runs[label] = _replay(wl, engine, direct_body(wl, model), label)
        runs[label]["trace_page_hit_fraction"] = prefix_stats(wl)["page_hit_fraction"]
        offered[label] = engine_load * capacity["engine"]
    return {"config": {"runner": "live", "workload": cfg.to_dict(), "policy": policy, "load": load,
                       "engine": engine, "engine_load": engine_load, "server_env": env or {}, "offered_rps": offered,
                       "capacity_rps": capacity, "trace": prefix_stats(burst)}, "runs": runs}
    # ``trace``: the capacity burst's (first turns mostly); each run keeps its own trace's fraction


def prefix_live_routing(cfg: ChatPrefixConfig, *, policy: str = "spf", rate: float = 2.0, workers: int = 2,
                        env: dict[str, str] | None = None, workdir: Path = Path("var/bench/prefix")) -> dict[str, Any]:
    """Live routing: ``workers`` built-in instances with their prefix caches, the trace at ``rate``
    req/s, once with every batch on the pool queue (whichever instance takes it first) and once with
    prefix-aware routing (``COHORT_PREFIX_ROUTING``), each on a fresh stack."""
    runs: dict[str, dict[str, Any]] = {}
    wl = _at_rate(cfg, rate)
    for label, flag in {"pool queue": "false", "prefix-aware": "true"}.items():
        with spawned_stack(policy, {**(env or {}), "COHORT_PREFIX_CACHING": "true", "COHORT_PREFIX_ROUTING": flag},
                           workdir / f"routing-{flag}", workers=workers) as url:
            runs[label] = _replay_counted(wl, url, served_model(f"{url}/v1"), label)
    return {"config": {"runner": "live-routing", "workload": cfg.to_dict(), "policy": policy, "rate_rps": rate,
                       "workers": workers, "server_env": env or {}, "trace": prefix_stats(wl)}, "runs": runs}


def ratios(runs: dict[str, dict[str, Any]], base: str, keys: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """Each run's ``keys`` over the ``base`` run's."""
    b = runs[base]
    return {name: {k: (m[k] / b[k] if b.get(k) else None) for k in keys if k in m} for name, m in runs.items()}
