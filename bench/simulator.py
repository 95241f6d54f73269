"""Discrete-event simulation of N LLM instances fed by one batching policy.

Events are arrivals (the workload's Poisson trace) and batch completions. After every event,
while an instance is idle and the policy has work, ``policy.pop(now)`` chooses a batch —
exactly the live batcher's contract (nothing is handed out before an instance is free).

A batch runs for ``time_model.estimate(β, L(B), G(B))`` with the batch's *true* G(B) (the
static batch decodes until its longest member ends). If MEM(B) with true lengths exceeds Θ
the batch runs out of memory at the decode step where β·(L(B)+g)·Δ passes Θ: the instance is
busy until then, then the batch is split in halves (``batcher.oom.split_batch``) and both are
re-queued; a batch of one that cannot fit fails its request. Every request therefore ends
either completed or failed, and ``completed + failed`` equals the requests sent.

Pure Python/NumPy: the policies are the live batcher's own classes.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from batcher.memory import KVMemory
from batcher.oom import UnsplittableBatch, split_batch
from batcher.policies import PolicyContext, make_policy, planning_memory
from batcher.policies.base import BatchTimeModel
from batcher.wma import total_wma
from cohort.types import Batch, ProfiledRequest

METRICS = ("request_throughput", "valid_token_throughput", "total_token_throughput", "mean_latency_s",
           "p50_latency_s", "p99_latency_s", "slo_attainment", "total_wma", "mean_batch_size",
           "oom_splits", "completed", "failed")


def parse_policy(name: str) -> tuple[str, bool]:
    """``magnus+oracle`` → ("magnus", True): the policy sees true lengths as predictions."""
    base, _, suffix = name.partition("+")
    if suffix and suffix != "oracle":
        raise ValueError(f"{name!r}: the only suffix is +oracle")
    return base, bool(suffix)


@dataclass
class SimResult:
    """Per-request outcomes and per-batch records of one simulated run, and its metrics."""

    policy: str
    metrics: dict[str, float]
    wall_s: float
    batches: int
    sim_time_s: float
    extra: dict[str, Any] = field(default_factory=dict)


def compute_metrics(arrival: np.ndarray, finish: np.ndarray, ok: np.ndarray, deadline: np.ndarray,
                    true_tokens: np.ndarray, batch_sizes: Sequence[int], padded_tokens: float,
                    wma: float, oom_splits: int) -> dict[str, float]:
    """The benchmark metrics from per-request outcomes (shared with the live runner).

    Throughputs are per second of makespan (first arrival to last completion). SLO attainment
    counts a request as met only if it completed by its deadline (failures miss).
    """
    n = len(arrival)
    completed = int(ok.sum())
    span = (float(np.max(finish[ok])) - float(np.min(arrival))) if completed else 0.0
    lat = (finish - arrival)[ok]
    per_s = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    return {
        "request_throughput": per_s(completed),
        "valid_token_throughput": per_s(float(true_tokens[ok].sum())),
        "total_token_throughput": per_s(float(padded_tokens)),
        "mean_latency_s": float(lat.mean()) if completed else math.nan,
        "p50_latency_s": float(np.percentile(lat, 50)) if completed else math.nan,
        "p99_latency_s": float(np.percentile(lat, 99)) if completed else math.nan,
        "slo_attainment": float((ok & (finish <= deadline + 1e-9)).sum() / n) if n else math.nan,
        "total_wma": float(wma),
        "mean_batch_size": float(np.mean(batch_sizes)) if len(batch_sizes) else 0.0,
        "oom_splits": int(oom_splits),
        "completed": completed,
        "failed": int(n - completed),
    }


def simulate(requests: Sequence[ProfiledRequest], policy: str, memory: KVMemory, time_model: BatchTimeModel,
             instances: int = 8, estimator: BatchTimeModel | None = None, max_input_tokens: int = 2048,
             max_tokens_limit: int = 2048, params: dict[str, Any] | None = None,
             progress: Callable[[int], None] | None = None, headroom: float = 0.0) -> SimResult:
    """Run one policy over a request trace (sorted by arrival) on ``instances`` identical instances.

    ``requests`` must carry ``true_tokens``; the policy reads ``predicted_tokens`` (build the
    list with ``Workload.requests(oracle=True)`` for ``NAME+oracle``). ``estimator`` is the
    policy's batch-time estimate (default: the time model itself). ``progress(k)`` is called
    with the number of newly finished requests (completed or failed). ``headroom`` makes the
    policy plan with Θ·(1 − headroom) while the instance still has Θ: slack for under-predicted
    lengths, so fewer batches run out of memory (0 = the policy sees the true Θ, as in SPEC;
    VS always plans with Θ).
    """
    t0 = time.perf_counter()
    base, _ = parse_policy(policy)
    ctx = PolicyContext(memory=planning_memory(base, memory, headroom), estimator=estimator or time_model,
                        max_input_tokens=max_input_tokens, max_tokens_limit=max_tokens_limit)
    params = {"threshold": 200_000.0, **(params or {})}
    pol = make_policy(base, ctx, **params)

    n = len(requests)
    index = {r.id: i for i, r in enumerate(requests)}
    arrival = np.array([r.arrival for r in requests], dtype=float)
    deadline = np.array([r.deadline for r in requests], dtype=float)
    true = np.array([r.true_tokens for r in requests], dtype=np.int64)
    finish = np.full(n, math.inf)
    ok = np.zeros(n, dtype=bool)
    order = np.argsort(arrival, kind="stable")

    theta, delta = memory.theta_bytes, memory.delta_bytes
    idle = instances
    heap: list[tuple[float, int, Batch, bool]] = []  # (finish time, seq, batch, ran out of memory)
    seq = 0
    sizes: list[int] = []
    padded = 0.0
    busy = 0.0
    sum_gb = 0
    sum_lb = 0
    wma = 0
    ooms = 0
    n_batches = 0
    i = 0
    now = 0.0
    estimate = time_model.estimate

    def dispatch(now: float) -> None:
        nonlocal idle, seq, n_batches, busy
        while idle > 0:
            b = pol.pop(now)
            if b is None:
                return
            reqs = b.requests
            beta = len(reqs)
            L_B = max(r.input_tokens for r in reqs)
            G_B = max(r.true_tokens for r in reqs)
            n_batches += 1
            if beta * (L_B + G_B) * delta > theta:
                # out of memory at the first decode step whose KV no longer fits
                g_oom = max(0, min(G_B, theta // (beta * delta) - L_B + 1))
                heapq.heappush(heap, (now + estimate(beta, L_B, g_oom), seq, b, True))
            else:
                dt = estimate(beta, L_B, G_B)
                busy += dt
                heapq.heappush(heap, (now + dt, seq, b, False))
            seq += 1
            idle -= 1

    while i < n or heap:
        t_arr = arrival[order[i]] if i < n else math.inf
        if heap and heap[0][0] < t_arr:
            now, _, b, oom = heapq.heappop(heap)
            idle += 1
            if oom:
                try:
                    h1, h2 = split_batch(b)
                except UnsplittableBatch:
                    j = index[b.requests[0].id]
                    finish[j] = now
                    if progress:
                        progress(1)
                else:
                    ooms += 1
                    pol.requeue(h1, now)
                    pol.requeue(h2, now)
            else:
                reqs = b.requests
                G_B = 0
                lengths = []
                for r in reqs:
                    j = index[r.id]
                    finish[j] = now
                    ok[j] = True
                    lengths.append((r.input_tokens, r.true_tokens))
                    if r.true_tokens > G_B:
                        G_B = r.true_tokens
                sizes.append(len(reqs))
                sum_gb += G_B
                sum_lb += max(x[0] for x in lengths)
                padded += len(reqs) * G_B
                wma += total_wma(lengths)
                if progress:
                    progress(len(reqs))
        else:
            now = float(t_arr)
            pol.add(requests[order[i]], now)
            i += 1
        if idle > 0:
            dispatch(now)

    metrics = compute_metrics(arrival, finish, ok, deadline, true, sizes, padded, wma, ooms)
    return SimResult(policy, metrics, time.perf_counter() - t0, n_batches, now,
                     {"params": dict(params), "busy_frac": busy / (instances * now) if now else 0.0,
                      "mean_batch_gen_len": sum_gb / max(1, len(sizes)),
                      "mean_batch_input_len": sum_lb / max(1, len(sizes))})
