"""`cohort bench upstream`: an engine direct against cohort in front of it, same seeded workload,
one run. The engine (vLLM, `transformers serve`, …) is started by the caller (recipe:
docs/notes/upstream.md); cohort stacks are spawned per target with COHORT_UPSTREAMS pointing at it, or
on the built-in engine (``builtin:<policy>``). Targets run in the order given, each over every
load, so ``direct,…,direct`` is the A-B-A order that shows the machine's drift. ``direct-fcfs`` is
the same engine started without priority scheduling (``--fcfs-upstream``; vLLM's default, FCFS),
beside ``direct``, the engine cohort feeds, with priority scheduling on and unused by the client.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm

from bench.live_stack import parse_env, spawned_stack
from bench.report import pyplot
from bench.upstream_bench import (
    cohort_body,
    direct_body,
    per_request,
    replay_streams,
    served_model,
    summarize,
)
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime

RATIO_KEYS = ("throughput_rps", "mean_latency_s", "p50_latency_s", "p99_latency_s", "mean_ttft_s", "p50_ttft_s",
              "mean_itl_s", "goodput_rps")


def _labels(targets: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for t in targets:
        seen[t] = seen.get(t, 0) + 1
        out.append(t if seen[t] == 1 else f"{t}#{seen[t]}")
    return out


def _plot(by_load: dict[str, dict[str, Any]], path: Path) -> None:
    plt = pyplot()
    keys = ("throughput_rps", "mean_latency_s", "p50_latency_s", "p99_latency_s", "mean_ttft_s", "goodput_rps")
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4))
    loads = list(by_load)
    targets = list(next(iter(by_load.values())))
    width = 0.8 / max(1, len(targets))
    for ax, key in zip(axes, keys, strict=True):
        for j, t in enumerate(targets):
            ax.bar([i + j * width for i in range(len(loads))], [by_load[lo][t][key] for lo in loads], width, label=t)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))], [f"{lo}x" for lo in loads])
        ax.set_title(key)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def upstream(
    engine: str = typer.Option(..., "--upstream", help="The engine's base URL ending in /v1 (loopback)."),
    targets: str = typer.Option("direct,magnus,spf,slo-odbs,direct", help="Comma-separated: direct (the engine "
                                "itself), direct-fcfs (the --fcfs-upstream engine), a policy (cohort in front of "
                                "the engine), builtin:<policy> (cohort's own engine). Ratios are to the first "
                                "direct or direct-fcfs run."),
    fcfs_engine: str = typer.Option(None, "--fcfs-upstream", help="The same engine and model started without "
                                    "priority scheduling (vLLM's default FCFS), for the direct-fcfs target."),
    loads: str = typer.Option("0.5,0.9,1.5", help="Offered loads as fractions of the engine's capacity."),
    capacity: float = typer.Option(0.0, help="Requests/s the engine completes; 0: measure it with a burst first "
                                   "(done/span: what it sustained under a Poisson overload too)."),
    burst: bool = typer.Option(False, help="Every request within 1.5 s (the KV-bound burst) instead of Poisson."),
    requests: int = typer.Option(300), seed: int = typer.Option(0),
    max_tokens: int = typer.Option(256, help="The client's bound; true lengths are capped here."),
    data: list[Path] = typer.Option(None, help="Shared-data JSONL files (default: the 8 Magnus tasks)."),
    server_env: list[str] = typer.Option(None, help="KEY=VALUE for the spawned cohort stacks (repeat)."),
    workdir: Path = typer.Option(Path("var/bench/upstream")),
    json_out: Path = typer.Option(None, "--json"), plot: Path = typer.Option(None),
    warmup: int = typer.Option(0, help="Requests (another seed's prompts, at the first load's rate) each target "
                               "serves before it is measured: cohort's predictor then starts from what it "
                               "learnt online, as a stack that has seen traffic does."),
    rows: bool = typer.Option(False, "--per-request", help="Also write each request's sent/first/done times "
                              "and tokens per target and load (paired comparisons) into the JSON."),
) -> None:
    """Replay one workload against the engine direct and cohort in front of it; ratios to the first
    direct run."""
    files = [str(p) for p in (data or data_files())]
    data_rows = build_rows(files, None)
    model = served_model(engine)
    env = parse_env(server_env)

    def workload(rate: float, n: int = requests, seed: int = seed):
        return make_workload(WorkloadConfig(files=files, requests=n, rate=rate, seed=seed,
                                            max_tokens=max_tokens), AnalyticBatchTime(), data_rows)

    def rate_of(load: float) -> float:
        """Offered req/s: a burst sends every request within 1.5 s, whatever the load."""
        return requests / 1.5 if burst else max(0.01, load * capacity)

    names = [t.strip() for t in targets.split(",") if t.strip()]
    directs = {"direct": (engine, model)}
    if "direct-fcfs" in names:
        if not fcfs_engine:
            raise typer.BadParameter("the direct-fcfs target needs --fcfs-upstream URL")
        directs["direct-fcfs"] = (fcfs_engine, served_model(fcfs_engine))
    measured = None
    if capacity <= 0:
        wl = workload(requests / 1.5)
        measured = summarize(wl, _replay("capacity (direct burst)", wl, engine, direct_body(wl, model)))
        capacity = measured["throughput_rps"]
        typer.echo(f"engine capacity: {capacity:.2f} req/s")
    fracs = [float(x) for x in loads.split(",") if x.strip()]
    by_load: dict[str, dict[str, Any]] = {f"{f:g}": {} for f in fracs}
    detail: dict[str, dict[str, Any]] | None = {f"{f:g}": {} for f in fracs} if rows else None
    warm = workload(rate_of(fracs[0]), warmup, seed + 1) if warmup else None
    for label, target in zip(_labels(names), names, strict=True):
        if target in directs:
            url, name = directs[target]
            _all_loads(label, fracs, rate_of, workload, url, lambda wl, name=name: direct_body(wl, name), by_load,
                       detail, warm)
            continue
        builtin = target.startswith("builtin:")
        policy = target.removeprefix("builtin:")
        stack_env = {**env} if builtin else {**env, "COHORT_UPSTREAMS": engine}
        with spawned_stack(policy, stack_env, workdir / label.replace(":", "_").replace("#", "_")) as url:
            served = served_model(f"{url}/v1")
            _all_loads(label, fracs, rate_of, workload, f"{url}/v1", lambda wl, served=served: cohort_body(wl, served),
                       by_load, detail, warm)
    base = next((lb for lb, t in zip(_labels(names), names, strict=True) if t in directs), None)
    ratios = {lo: {t: {k: (m[k] / runs[base][k] if base and runs[base][k] else None) for k in RATIO_KEYS}
                   for t, m in runs.items()} for lo, runs in by_load.items()} if base else {}
    config = {"engine": engine, "fcfs_engine": fcfs_engine, "model": model, "targets": names, "loads": fracs,
              "capacity_rps": capacity, "burst": burst, "requests": requests, "seed": seed,
              "max_tokens": max_tokens, "files": files, "server_env": env, "capacity_burst": measured,
              "warmup": {"requests": warmup, "seed": seed + 1} if warmup else None}
    out = {"config": config, "by_load": by_load, "ratios_to": base, "ratios": ratios}
    if detail is not None:
        out["per_request"] = detail
    for lo, runs in by_load.items():
        typer.echo(f"\nload {lo}x ({float(lo) * capacity:.1f} req/s)")
        for t, m in runs.items():
            r = ratios.get(lo, {}).get(t, {})
            typer.echo(f"  {t:>16}: {m['throughput_rps']:6.2f} req/s, mean {m['mean_latency_s']:.2f} s "
                       f"(x{r.get('mean_latency_s') or 0:.2f}), p50 {m['p50_latency_s']:.2f} s, p99 "
                       f"{m['p99_latency_s']:.2f} s, TTFT {m['mean_ttft_s']:.3f} s, goodput {m['goodput_rps']:.2f}"
                       f", lost {m['lost']}")
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(out, indent=2, default=float))
    if plot:
        _plot(by_load, plot)


def _replay(desc: str, wl, base_url: str, body):
    """Replay ``wl`` against ``base_url`` with a progress bar; its ``StreamResult``."""
    with tqdm(total=len(wl), desc=desc, unit="req") as bar:
        return asyncio.run(replay_streams(wl, base_url, body, progress=bar.update))


def _all_loads(label, fracs, rate_of, workload, base_url, body_of, by_load, detail, warm) -> None:
    if warm is not None:
        _replay(f"{label} warm-up", warm, base_url, body_of(warm))
    for f in fracs:
        wl = workload(rate_of(f))
        res = _replay(f"{label} @ {f:g}x", wl, base_url, body_of(wl))
        by_load[f"{f:g}"][label] = summarize(wl, res)
        if detail is not None:
            detail[f"{f:g}"][label] = per_request(res)
