"""What a soak's outcomes and samples add up to: per-window latency, first against last, totals,
resource slopes. Pure functions over plain records, so they are tested without a stack and the
progress line can read the latest window cheaply (bench.soak drives the stack). The soak's
timeline comes in as numbers (``warmup_s``: what is left out of the after-warm-up figures;
``end_s``: when sending stopped), not as the driver's ``SoakConfig``: the driver imports these
functions, never the other way round."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

_UUID_TAIL = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


def key_family(key: str) -> str:
    """A Redis key's family: its first two ``:`` segments, a trailing UUID replaced by ``*``.

    Celery's result keys (``celery-task-meta-<uuid>``) have no ``:``; counted by their whole
    name, every one was a family of its own and each sample listed them all (a 2-hour soak's
    JSON grew to 4 MB of them)."""
    return _UUID_TAIL.sub("*", ":".join(key.split(":")[:2]))


KINDS = ("chat", "chat_stream", "chat_n2", "completion", "generate", "leave", "bad")


@dataclass
class Outcome:
    kind: str
    sent: float
    latency: float | None = None
    status: int | None = None          # HTTP status; None: no answer at all (lost)
    stream_error: bool = False         # an error event inside a 200 stream
    error: str | None = None           # the client's transport error, when there was one


def slope_pct_per_h(ts: list[float], ys: list[float]) -> float | None:
    """Least-squares slope of ``ys`` over ``ts`` (s), as % of the mean per hour."""
    if len(ts) < 3 or not np.mean(ys):
        return None
    k = np.polyfit(np.asarray(ts), np.asarray(ys), 1)[0]
    return float(100.0 * k * 3600.0 / np.mean(ys))


def _window_stats(inw: list[Outcome], start_s: float) -> dict[str, Any]:
    lat = [o.latency for o in inw if o.kind not in ("leave", "bad") and o.status == 200 and o.latency is not None]
    return {"start_s": start_s, "sent": len(inw), "answered": len(lat),
            "5xx": sum(1 for o in inw if o.status is not None and o.status >= 500),
            "p50_s": float(np.percentile(lat, 50)) if lat else None,
            "p99_s": float(np.percentile(lat, 99)) if lat else None}


def windows(outcomes: list[Outcome], window_s: float) -> list[dict[str, Any]]:
    """Per window of send time: answered, 5xx, p50/p99 latency of the answered (non-leaving, non-bad) ones."""
    n = int(math.ceil(max((o.sent for o in outcomes), default=0.0) / window_s)) or 1
    groups: list[list[Outcome]] = [[] for _ in range(n)]
    for o in outcomes:
        groups[min(n - 1, int(o.sent // window_s))].append(o)
    return [_window_stats(g, w * window_s) for w, g in enumerate(groups)]


def last_window(outcomes: list[Outcome], window_s: float) -> dict[str, Any]:
    """The latest window's figures from the tail of the send-ordered outcomes only.

    The progress line runs every sample inside the event loop that times the requests; scanning
    every outcome for every window there grew with the run (O(n x windows): about a second per
    sample after an hour at 10 req/s) and delayed the very requests the soak was timing.
    """
    if not outcomes:
        return {}
    start = (outcomes[-1].sent // window_s) * window_s
    tail: list[Outcome] = []
    for o in reversed(outcomes):
        if o.sent < start:
            break
        tail.append(o)
    return _window_stats(tail, start)


def first_last(outcomes: list[Outcome], *, warmup_s: float, end_s: float, span_s: float = 600.0) -> dict[str, Any]:
    """p50/p99 of the first ``span_s`` after warm-up against the last ``span_s`` of sending (the
    issue's target: last ≤ 1.2 × first); shorter runs split what is after warm-up in halves."""
    span = min(span_s, (end_s - warmup_s) / 2)

    def pct(lo: float, hi: float) -> dict[str, float | None]:
        lat = [o.latency for o in outcomes if o.kind not in ("leave", "bad") and o.status == 200
               and o.latency is not None and lo <= o.sent < hi]
        return {"n": len(lat), "p50_s": float(np.percentile(lat, 50)) if lat else None,
                "p99_s": float(np.percentile(lat, 99)) if lat else None}

    first, last = pct(warmup_s, warmup_s + span), pct(end_s - span, end_s)
    ratio = {k: last[k] / first[k] if first[k] and last[k] is not None else None for k in ("p50_s", "p99_s")}
    return {"span_s": span, "first": first, "last": last, "last_over_first": ratio}


def summarize(outcomes: list[Outcome], *, warmup_s: float, end_s: float, wall_s: float) -> dict[str, Any]:
    """Totals a soak must hold: no 5xx, nothing lost, bad bodies 4xx, throughput after warm-up."""
    regular = [o for o in outcomes if o.kind not in ("leave", "bad")]
    # throughput = answers completed between warm-up and the end of sending: the service rate
    # even when the stack is overloaded (then what was sent late finishes after the window)
    after = [o for o in regular if o.latency is not None and warmup_s <= o.sent + o.latency < end_s]
    span = max(1e-9, end_s - warmup_s)
    return {
        "sent": len(outcomes), "by_kind": {k: sum(1 for o in outcomes if o.kind == k) for k in KINDS},
        "answered_200": sum(1 for o in regular if o.status == 200 and not o.stream_error),
        "server_errors_5xx": sum(1 for o in outcomes if o.status is not None and o.status >= 500),
        "stream_errors": sum(1 for o in outcomes if o.stream_error),
        "lost": sum(1 for o in outcomes if o.status is None and o.kind != "leave"),
        "lost_by_error": dict(Counter(o.error or "none" for o in outcomes if o.status is None and o.kind != "leave")),
        "bad_not_4xx": sum(1 for o in outcomes if o.kind == "bad" and not (o.status and 400 <= o.status < 500)),
        "other_non_200": sum(1 for o in regular if o.status is not None and o.status != 200),
        "status_counts": {str(k): v for k, v in sorted(Counter(o.status for o in outcomes).items(), key=str)},
        "throughput_rps_after_warmup": sum(1 for o in after if o.status == 200 and not o.stream_error) / span,
        "wall_s": round(wall_s, 1)}


def resource_trends(samples: list[dict[str, Any]], warmup_s: float) -> dict[str, Any]:
    """Slopes after warm-up (%/h): RSS per process, Redis memory."""
    after = [s for s in samples if s["t"] >= warmup_s]
    ts = [s["t"] for s in after]
    names = sorted({n for s in after for n in s["rss_mb"]})
    return {"rss_slope_pct_per_h": {n: slope_pct_per_h([s["t"] for s in after if n in s["rss_mb"]],
                                                        [s["rss_mb"][n] for s in after if n in s["rss_mb"]]) for n in names},
            "redis_slope_pct_per_h": slope_pct_per_h(ts, [s["redis_used_mb"] for s in after]),
            "data_dir_mb": {"first": after[0]["data_dir_mb"] if after else None,
                            "last": after[-1]["data_dir_mb"] if after else None}}




def engine_windows(samples: list[dict[str, Any]], window_s: float) -> list[dict[str, Any]]:
    """Per window, from the resource samples: each engine's mean step time and rows per step (the
    change of its running totals over the window), rows resident and groups waiting at the window's
    end, the batcher's queue and each process's mean CPU — what separates load from a slowing engine."""
    out: list[dict[str, Any]] = []
    if not samples:
        return out
    n = int(math.ceil(samples[-1]["t"] / window_s)) or 1
    prev = samples[0]
    for w in range(n):
        inside = [s for s in samples if w * window_s < s["t"] <= (w + 1) * window_s]
        if not inside:
            continue
        last = inside[-1]
        engines = {}
        for name, c in last.get("engines", {}).items():
            p = prev.get("engines", {}).get(name, {})
            steps = c.get("steps", 0) - p.get("steps", 0)
            engines[name] = {"steps": steps,
                             "step_ms": 1e3 * (c.get("busy_s", 0) - p.get("busy_s", 0)) / steps if steps else None,
                             "rows_per_step": (c.get("row_steps", 0) - p.get("row_steps", 0)) / steps if steps else None,
                             "rows": c.get("rows"), "waiting_groups": c.get("waiting_groups")}
        cpu: dict[str, float] = {}
        for s in inside:
            for k, v in s.get("cpu_pct", {}).items():
                cpu[k] = cpu.get(k, 0.0) + v / len(inside)
        steal = [s["host_steal_pct"] for s in inside if s.get("host_steal_pct") is not None]
        out.append({"start_s": w * window_s, "engines": engines, "queued_mean": sum(s.get("queued", 0) for s in inside)
                    / len(inside), "cpu_pct": {k: round(v, 1) for k, v in cpu.items()},
                    "host_steal_pct": round(sum(steal) / len(steal), 1) if steal else None})
        prev = last
    return out


STEAL_LIMIT_PCT = 5.0  # a window whose host lost more CPU than this to other guests measures the host


def steadiness(windows_: list[dict[str, Any]], last: int = 3,
               engine_windows_: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Each window's median against the first window's, and the steady soak's two checks: every
    window within 1.5x of the first, the last ``last`` within 1.2x. A trailing window shorter than
    the others (sending stopped inside it) is left out: it holds a few seconds of traffic. With the
    engine windows, the windows whose host CPU steal exceeded ``STEAL_LIMIT_PCT`` are named: the
    checks still run, but a miss there says the VM was starved, not that the stack drifted."""
    out = _ratios(windows_, last)
    if engine_windows_ is not None:
        out["host_steal_pct"] = [w.get("host_steal_pct") for w in engine_windows_]
        out["starved_windows"] = [i for i, w in enumerate(engine_windows_)
                                  if (w.get("host_steal_pct") or 0.0) > STEAL_LIMIT_PCT]
    return out


def _ratios(windows_: list[dict[str, Any]], last: int) -> dict[str, Any]:
    full = [w for w in windows_ if w.get("p50_s") is not None]
    if len(full) > 1 and full[-1]["sent"] < 0.5 * full[-2]["sent"]:
        full = full[:-1]
    if not full:
        return {"ratios": [], "every_window_le_1_5": None, "last_le_1_2": None}
    base = full[0]["p50_s"]
    ratios = [round(w["p50_s"] / base, 3) for w in full]
    return {"minute0_p50_s": base, "ratios": ratios, "worst": max(ratios), f"last{last}": ratios[-last:],
            "every_window_le_1_5": max(ratios) <= 1.5, "last_le_1_2": max(ratios[-last:]) <= 1.2}
