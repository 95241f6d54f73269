"""The benchmark metrics, one definition for the simulators and the live runner.

Why one module: every runner (batch simulator, continuous simulator, AdaptiveLLM experiment, live
replay) reports the same names computed the same way, so their tables can sit side by side.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from cohort.types import ProfiledRequest

METRICS = ("request_throughput", "valid_token_throughput", "total_token_throughput", "mean_latency_s",
           "p50_latency_s", "p99_latency_s", "mean_ttft_s", "p50_ttft_s", "p99_ttft_s", "slo_attainment",
           "total_wma", "mean_batch_size", "oom_splits", "preemptions", "wasted_tokens", "wasted_token_frac",
           "recomputed_tokens", "weighted_turnaround", "completed", "failed")


class TraceBook:
    """Per-request outcomes of one simulated trace: every simulator keeps the same arrays.

    Why one class: the batch simulator, the continuous engine and the AdaptiveLLM experiment all
    index requests by id, record first dispatch, first token and end, and settle each request
    exactly once (answered or failed); writing that once keeps "nothing lost" checkable in one place.
    """

    def __init__(self, requests: Sequence[ProfiledRequest], progress: Callable[[int], None] | None = None) -> None:
        n = len(requests)
        self.index = {r.id: i for i, r in enumerate(requests)}
        self.arrival = np.array([r.arrival for r in requests], dtype=float)
        self.deadline = np.array([r.deadline for r in requests], dtype=float)
        self.true = np.array([r.true_tokens for r in requests], dtype=np.int64)
        self.finish = np.full(n, math.inf)
        self.first = np.full(n, math.inf)
        self.scheduled = np.full(n, math.inf)   # first dispatch (AdaptiveLLM's weighted turnaround)
        self.ok = np.zeros(n, dtype=bool)
        self.order = np.argsort(self.arrival, kind="stable")
        self.progress = progress

    def settle(self, j: int, at: float, done: bool) -> None:
        """Request ``j`` ends at ``at``: answered (``done``) or failed."""
        self.finish[j] = at
        self.ok[j] = done
        if self.progress:
            self.progress(1)

    def first_token(self, j: int, at: float) -> None:
        if at < self.first[j]:
            self.first[j] = at

    def dispatched(self, j: int, at: float) -> None:
        if at < self.scheduled[j]:
            self.scheduled[j] = at

    def fail_unsettled(self, at: float) -> None:
        """Nothing should be left unsettled at the end of a run; if something is, it failed."""
        for j in np.flatnonzero(~np.isfinite(self.finish)):
            self.settle(int(j), at, False)

    def metrics(self, batch_sizes: Sequence[int], padded_tokens: float, wma: float, oom_splits: int,
                **kw: Any) -> dict[str, float]:
        return compute_metrics(self.arrival, self.finish, self.ok, self.deadline, self.true, batch_sizes,
                               padded_tokens, wma, oom_splits, first_token=self.first, scheduled=self.scheduled,
                               **kw)


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
                    wma: float, oom_splits: int, first_token: np.ndarray | None = None, preemptions: int = 0,
                    wasted_tokens: int = 0, decoded_tokens: int = 0, recomputed_tokens: int = 0,
                    scheduled: np.ndarray | None = None) -> dict[str, float]:
    """The benchmark metrics from per-request outcomes (shared with the live runner).

    Throughputs are per second of makespan (first arrival to last completion). SLO attainment
    counts a request as met only if it completed by its deadline (failures miss). TTFT is the
    first token's time minus arrival (NaN when ``first_token`` is not known). ``wasted_tokens``
    are decoded row-steps thrown away by split-and-restart, ``wasted_token_frac`` their share of
    all decoded row-steps; ``recomputed_tokens`` are generated tokens re-prefilled when a
    preempted request resumes. ``weighted_turnaround`` is AdaptiveLLM's eq. 5 averaged over the
    completed requests: (finish − send) ÷ (finish − first scheduled), ≥ 1, the share of a request's
    time spent waiting before it first ran (NaN when ``scheduled`` is not known).
    """
    n = len(arrival)
    completed = int(ok.sum())
    span = (float(np.max(finish[ok])) - float(np.min(arrival))) if completed else 0.0
    lat = (finish - arrival)[ok]
    per_s = (lambda x: x / span) if span > 0 else (lambda x: 0.0)
    ttft = (first_token - arrival)[ok] if first_token is not None else np.array([])
    ttft = ttft[np.isfinite(ttft)]
    return {
        "request_throughput": per_s(completed),
        "valid_token_throughput": per_s(float(true_tokens[ok].sum())),
        "total_token_throughput": per_s(float(padded_tokens)),
        "mean_latency_s": float(lat.mean()) if completed else math.nan,
        "p50_latency_s": float(np.percentile(lat, 50)) if completed else math.nan,
        "p99_latency_s": float(np.percentile(lat, 99)) if completed else math.nan,
        "mean_ttft_s": float(ttft.mean()) if len(ttft) else math.nan,
        "p50_ttft_s": float(np.percentile(ttft, 50)) if len(ttft) else math.nan,
        "p99_ttft_s": float(np.percentile(ttft, 99)) if len(ttft) else math.nan,
        "slo_attainment": float((ok & (finish <= deadline + 1e-9)).sum() / n) if n else math.nan,
        "total_wma": float(wma),
        "mean_batch_size": float(np.mean(batch_sizes)) if len(batch_sizes) else 0.0,
        "oom_splits": int(oom_splits),
        "preemptions": int(preemptions),
        "wasted_tokens": int(wasted_tokens),
        "wasted_token_frac": float(wasted_tokens / decoded_tokens) if decoded_tokens else 0.0,
        "recomputed_tokens": int(recomputed_tokens),
        "weighted_turnaround": weighted_turnaround(arrival, finish, ok, scheduled),
        "completed": completed,
        "failed": int(n - completed),
    }


def weighted_turnaround(send: np.ndarray, finish: np.ndarray, ok: np.ndarray, scheduled: np.ndarray | None
                        ) -> float:
    """Mean of (finish − send) / (finish − first scheduled) over completed requests (eq. 5)."""
    if scheduled is None or not ok.any():
        return math.nan
    served = np.maximum(finish[ok] - scheduled[ok], 1e-9)
    return float(np.mean((finish[ok] - send[ok]) / served))
