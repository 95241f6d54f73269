"""The benchmark tables and plots: one reading of a results JSON for every runner.

Why apart from the commands: ``bench sim``, ``bench live`` and ``bench adaptive`` print the same
ratio table and draw the same plots, so the columns (ratios to VS, to ``cb-fcfs`` — vLLM's default
scheduler in the simulator — and to the physical bound) are written once.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import typer

from bench.continuous_run import CB_FCFS


def pyplot():
    """matplotlib's pyplot on the Agg backend (files only, no display) for every plot of the
    benchmarks: matplotlib is optional and slow to import, so only when a plot is asked for."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def base_key(policies: dict[str, Any], policy: str = "vs") -> str:
    """The first result key of ``policy`` (``vs``, ``vs@static``, ``vs@elastic``…), else ``policy``."""
    return next((k for k in policies if k == policy or k.startswith(policy + "@")), policy)


def _ratio(m: dict[str, float], b: dict[str, float] | None, key: str) -> float:
    v = b.get(key) if b else None
    return m.get(key, math.nan) / v if v and math.isfinite(v) else math.nan


def ratio_table(policies: dict[str, dict[str, float]], base: str = "vs", versus: str | None = None) -> str:
    """Throughput, latency, TTFT, SLO attainment, AdaptiveLLM's weighted turnaround (WT), their
    ratios against ``base`` (and ``versus``), against ``cb-fcfs`` when it ran (throughput, mean
    latency, TTFT, p99) and throughput over the physical bound when it is known, then OOM splits,
    preemptions, generated tokens prefilled again after a preemption and the share of decoded
    tokens thrown away."""
    refs = [r for r in dict.fromkeys([base] + ([versus] if versus else [])) if r in policies]
    widths = [len(r) + 4 for r in refs]
    cb = policies.get(CB_FCFS)
    cols = "".join(f" {'thr/' + r:>{w}s} {'lat/' + r:>{w}s}" for r, w in zip(refs, widths, strict=True))
    if cb:
        cols += " thr/cb lat/cb ttft/cb p99/cb"
    bound = any(math.isfinite(m.get("physical_bound_rps", math.nan)) for m in policies.values())
    if bound:
        cols += " thr/bound"
    head = (f"{'policy':26s} {'req/s':>8s} {'mean lat':>9s}{cols} {'p99 lat':>9s} {'TTFT':>8s} {'SLO att':>8s} "
            f"{'WT':>6s} {'batch':>7s} {'OOM':>5s} {'preempt':>7s} {'recomp':>8s} {'wasted':>7s} {'failed':>6s}")
    lines = [head, "-" * len(head)]
    for name, m in policies.items():
        ratios = ""
        for r, w in zip(refs, widths, strict=True):
            b = policies.get(r)
            ratios += f" {_ratio(m, b, 'request_throughput'):{w}.2f} {_ratio(m, b, 'mean_latency_s'):{w}.2f}"
        if cb:
            ratios += (f" {_ratio(m, cb, 'request_throughput'):6.2f} {_ratio(m, cb, 'mean_latency_s'):6.2f}"
                       f" {_ratio(m, cb, 'mean_ttft_s'):7.2f} {_ratio(m, cb, 'p99_latency_s'):6.2f}")
        if bound:
            bnd = m.get("physical_bound_rps", math.nan)
            ratios += f" {m['request_throughput'] / bnd if bnd else math.nan:9.2f}"
        lines.append(f"{name:26s} {m['request_throughput']:8.2f} {m['mean_latency_s']:9.2f}{ratios} "
                     f"{m['p99_latency_s']:9.2f} {m.get('mean_ttft_s', math.nan):8.2f} {m['slo_attainment']:8.3f} "
                     f"{m.get('weighted_turnaround', math.nan):6.2f} {m['mean_batch_size']:7.1f} "
                     f"{m['oom_splits']:5d} {m.get('preemptions', 0):7d} {m.get('recomputed_tokens', 0):8d} "
                     f"{m.get('wasted_token_frac', 0.0):7.3f} {m['failed']:6d}")
    return "\n".join(lines)


def plot_sweep(by_rate: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """throughput.png and latency.png: metric vs request rate, one line per policy."""
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    rates = sorted(by_rate, key=float)
    names = list(by_rate[rates[0]]["policies"])
    paths = []
    for metric, fname, label in (("request_throughput", "throughput.png", "request throughput (req/s)"),
                                 ("mean_latency_s", "latency.png", "mean latency (s)"),
                                 ("p99_latency_s", "p99_latency.png", "p99 latency (s)"),
                                 ("slo_attainment", "slo_attainment.png", "SLO attainment")):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for name in names:
            ax.plot([float(r) for r in rates], [by_rate[r]["policies"][name][metric] for r in rates],
                    marker="o", label=name)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        if metric.endswith("latency_s"):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        p = out / fname
        fig.savefig(p, dpi=120)
        plt.close(fig)
        paths.append(p)
    return paths


def _color(key: str) -> str:
    """One colour per execution mode (cb-fcfs, vLLM's baseline, in grey)."""
    if key == CB_FCFS:
        return "tab:gray"
    return {"elastic": "tab:orange", "continuous": "tab:green"}.get(key.partition("@")[2].partition("/")[0],
                                                                       "tab:blue")


def plot_runs(policies: dict[str, dict[str, float]], out: Path, name: str = "compare.png") -> Path:
    """One rate, many runs (e.g. static vs elastic): bars of throughput, mean latency and TTFT."""
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    keys = list(policies)
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.35 * len(keys) + 1.8), sharey=True)
    for ax, (metric, label) in zip(axes, (("request_throughput", "request throughput (req/s)"),
                                          ("mean_latency_s", "mean latency (s, log)"),
                                          ("mean_ttft_s", "mean TTFT (s, log)")), strict=True):
        vals = [policies[k].get(metric, math.nan) for k in keys]
        ax.barh(range(len(keys)), vals, color=[_color(k) for k in keys])
        ax.set_xlabel(label)
        if metric != "request_throughput":
            ax.set_xscale("log")
        ax.grid(alpha=0.3, axis="x")
    axes[0].set_yticks(range(len(keys)), keys, fontsize=8)
    axes[0].invert_yaxis()
    fig.tight_layout()
    p = out / name
    fig.savefig(p, dpi=120)
    plt.close(fig)
    return p


def write_result(result: dict[str, Any], json_out: Path | None, plot: Path | None) -> None:
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2, default=float))
        typer.echo(f"wrote {json_out}", err=True)
    if plot:
        by_rate = result.get("by_rate") or {str(result["config"]["rate"]): {"policies": result["policies"]}}
        paths = plot_sweep(by_rate, plot) if len(by_rate) > 1 else [plot_runs(result["policies"], plot)]
        for p in paths:
            typer.echo(f"wrote {p}", err=True)


