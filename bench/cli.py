"""`cohort bench ...`: run the batching policies on one workload, in the simulator or live.

``cohort bench sim`` simulates N instances (default: Magnus's testbed, ChatGLM-6B fp16 on a
V100-32GB, roofline batch times) for every policy on the *same* seeded workload; ``cohort bench
live`` replays that workload against a running stack. Both write
``{"config": {...}, "policies": {name: {metrics}}}``; with several rates, the top level holds the
last rate and ``by_rate`` holds every rate. A table of ratios against ``vs`` goes to stdout and
``--plot DIR`` draws throughput and latency against rate, one line per policy.

``bench sim`` compares execution modes side by side: ``--execution static,elastic`` runs every
policy under both, or a name carries its own, ``magnus@static`` (the paper: static batches,
split-and-restart on overflow) next to ``magnus@elastic`` (rows leave as they finish, overflow
preempts rows as continuations); keys in the JSON are ``POLICY[+oracle]@EXECUTION``
(``bench.simulator.parse_run``).
"""

from __future__ import annotations

import json
import math
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm

from bench.chaos import EXPERIMENTS, Outcome, run_all
from bench.live import check_loopback, run_live_sync
from bench.live_stack import parse_env, spawned_stack
from bench.roofline import Instance, fitted_time_model, instance
from bench.simulator import DEFAULT_THRESHOLD, parse_policy, parse_run, simulate
from bench.soak_cli import soak
from bench.workload import ORACLE, WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime

app = typer.Typer(help="Benchmarks: simulate or replay the policies on one workload.", no_args_is_help=True)

app.command()(soak)  # issue 23: `cohort bench soak` (bench/soak_cli.py)

DEFAULT_POLICIES = "vs,glp,abp,magnus,magnus+oracle,s3,slo-dbs,odbs,slo-odbs"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _files(data: list[Path] | None) -> list[str]:
    return [str(p) for p in (data or data_files())]


def _instance(gpu: str, model: str, theta_bytes: int | None, reserve_frac: float, step_overhead_s: float
              ) -> Instance:
    return instance(gpu, model, reserve_frac=reserve_frac, step_overhead_s=step_overhead_s,
                    theta_override=theta_bytes)


def base_key(policies: dict[str, Any], policy: str = "vs") -> str:
    """The first result key of ``policy`` (``vs``, ``vs@static``, ``vs@elastic``…), else ``policy``."""
    return next((k for k in policies if k == policy or k.startswith(policy + "@")), policy)


def ratio_table(policies: dict[str, dict[str, float]], base: str = "vs", versus: str | None = None) -> str:
    """Throughput, latency and SLO attainment, their ratios against ``base`` (and ``versus``),
    OOM splits, preemptions and the share of decoded tokens thrown away."""
    refs = [base] + ([versus] if versus else [])
    widths = [len(r) + 4 for r in refs]
    cols = "".join(f" {'thr/' + r:>{w}s} {'lat/' + r:>{w}s}" for r, w in zip(refs, widths, strict=True))
    head = (f"{'policy':26s} {'req/s':>8s} {'mean lat':>9s}{cols} {'p99 lat':>9s} {'TTFT':>8s} {'SLO att':>8s} "
            f"{'batch':>7s} {'OOM':>5s} {'preempt':>7s} {'wasted':>7s} {'failed':>6s}")
    lines = [head, "-" * len(head)]
    for name, m in policies.items():
        ratios = ""
        for r, w in zip(refs, widths, strict=True):
            b = policies.get(r)
            rt = m["request_throughput"] / b["request_throughput"] if b and b["request_throughput"] else math.nan
            rl = m["mean_latency_s"] / b["mean_latency_s"] if b and b["mean_latency_s"] else math.nan
            ratios += f" {rt:{w}.2f} {rl:{w}.2f}"
        lines.append(f"{name:26s} {m['request_throughput']:8.2f} {m['mean_latency_s']:9.2f}{ratios} "
                     f"{m['p99_latency_s']:9.2f} {m.get('mean_ttft_s', math.nan):8.2f} {m['slo_attainment']:8.3f} "
                     f"{m['mean_batch_size']:7.1f} {m['oom_splits']:5d} {m.get('preemptions', 0):7d} "
                     f"{m.get('wasted_token_frac', 0.0):7.3f} {m['failed']:6d}")
    return "\n".join(lines)


def plot_sweep(by_rate: dict[str, dict[str, Any]], out: Path) -> list[Path]:
    """throughput.png and latency.png: metric vs request rate, one line per policy."""
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def plot_runs(policies: dict[str, dict[str, float]], out: Path, name: str = "compare.png") -> Path:
    """One rate, many runs (e.g. static vs elastic): bars of throughput, mean latency and TTFT."""
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    keys = list(policies)
    fig, axes = plt.subplots(1, 3, figsize=(13, 0.35 * len(keys) + 1.8), sharey=True)
    for ax, (metric, label) in zip(axes, (("request_throughput", "request throughput (req/s)"),
                                          ("mean_latency_s", "mean latency (s, log)"),
                                          ("mean_ttft_s", "mean TTFT (s, log)")), strict=True):
        vals = [policies[k].get(metric, math.nan) for k in keys]
        ax.barh(range(len(keys)), vals, color=["tab:orange" if "@elastic" in k else "tab:blue" for k in keys])
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


def _write(result: dict[str, Any], json_out: Path | None, plot: Path | None) -> None:
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2, default=float))
        typer.echo(f"wrote {json_out}", err=True)
    if plot:
        by_rate = result.get("by_rate") or {str(result["config"]["rate"]): {"policies": result["policies"]}}
        paths = plot_sweep(by_rate, plot) if len(by_rate) > 1 else [plot_runs(result["policies"], plot)]
        for p in paths:
            typer.echo(f"wrote {p}", err=True)


@app.command()
def sim(
    data: list[Path] = typer.Option(None, help="Shared-data JSONL files (repeat); default: the 8 Magnus tasks."),
    predictor: str = typer.Option("oracle", help="Predictor model dir (cohort predictor train), or 'oracle'."),
    policies: str = typer.Option(DEFAULT_POLICIES, help="Comma-separated NAME\\[+oracle]\\[@EXECUTION\\[/RECOVERY]]; "
                                 "+oracle feeds true lengths; without @ a name runs under every --execution."),
    execution: str = typer.Option("elastic", help="Comma-separated execution modes: static (rows stay until the "
                                  "longest ends, the papers) | elastic (rows leave as they finish)."),
    oom_recovery: str = typer.Option(None, help="split | preempt for every run without /RECOVERY (default: the "
                                     "mode's own, split for static, preempt for elastic)."),
    max_preemptions: int = typer.Option(8, help="Rows preempted this often are evicted last."),
    versus: str = typer.Option(None, help="A second reference run for the ratio table, e.g. magnus+oracle@static."),
    rate: str = typer.Option("40", help="Request rate(s) in req/s, comma-separated for a sweep."),
    instances: int = typer.Option(8, help="LLM instances."),
    requests: int = typer.Option(10_000, help="Requests per run."),
    seed: int = typer.Option(0, help="Workload seed (task mix, rows, arrivals, SLOs)."),
    json_out: Path = typer.Option(None, "--json", help="Write the results JSON here."),
    plot: Path = typer.Option(None, help="Directory for throughput/latency-vs-rate plots."),
    gpu: str = typer.Option("v100-32gb", help="v100-32gb | a100-80gb | h100-80gb"),
    model: str = typer.Option("chatglm-6b", help="chatglm-6b | llama-7b | tiny"),
    batch_time: Path = typer.Option(None, help="Profiled samples JSON (cohort worker profile): fit the batch "
                                               "time instead of the roofline."),
    theta_bytes: int = typer.Option(None, help="Override Θ (KV bytes per instance)."),
    reserve_frac: float = typer.Option(0.1, help="Device memory kept for activations (Θ = mem − weights − this)."),
    step_overhead_s: float = typer.Option(0.01, help="Roofline: framework cost per decode step."),
    max_tokens: int = typer.Option(1024, help="max_tokens of every request (true lengths are capped here)."),
    max_input_tokens: int = typer.Option(1024, help="Longest allowed input (sets VS's worst-case batch size)."),
    threshold: float = typer.Option(DEFAULT_THRESHOLD, help="Φ for glp/abp/magnus (WMA token reads; default: "
                                    "the live batcher's COHORT_WMA_THRESHOLD default)."),
    batch_size: int = typer.Option(None, help="VS/GLP fixed batch size (default: worst case under Θ)."),
    l1: float = typer.Option(None, help="SLO-ODBS L1 (default in batcher.policies.slo)."),
    slo_k_min: float = typer.Option(2.0, help="SLO = U[k_min,k_max] × solo time."),
    slo_k_max: float = typer.Option(20.0),
    headroom: float = typer.Option(0.0, help="Policies plan with Θ·(1−headroom): slack for under-predictions."),
) -> None:
    """Simulate every policy on the same seeded workload; print ratios vs VS; write JSON/plots."""
    modes = [x.strip() for x in execution.split(",") if x.strip()]
    try:
        runs = [(name, *run) for p in policies.split(",") if (name := p.strip())
                for run in parse_run(name, modes, oom_recovery)]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    names = [name for name, *_ in runs]
    files = _files(data)
    inst = _instance(gpu, model, theta_bytes, reserve_frac, step_overhead_s)
    if batch_time:
        tm = fitted_time_model(batch_time)
        tm_desc = {"kind": "fitted", "samples": str(batch_time), **tm.to_dict()}
    else:
        tm = inst.time_model()
        tm_desc = tm.to_dict()
    pred = None if predictor == ORACLE else predictor
    needs_pred = any(not parse_policy(n)[1] for n in names)
    if pred is None and needs_pred:
        typer.echo("note: no --predictor: every policy sees true lengths (same as +oracle)", err=True)
    rows = build_rows(files, pred)
    params = {"threshold": threshold, "batch_size": batch_size, "l1": l1}
    params = {k: v for k, v in params.items() if v is not None}
    by_rate: dict[str, Any] = {}
    rates = _floats(rate)
    config: dict[str, Any] = {}
    for r in rates:
        wc = WorkloadConfig(files=files, requests=requests, rate=r, seed=seed, max_tokens=max_tokens,
                            predictor=pred, slo_k_min=slo_k_min, slo_k_max=slo_k_max)
        wl = make_workload(wc, tm, rows)
        lists = {False: wl.requests(oracle=False), True: wl.requests(oracle=True)}
        results: dict[str, Any] = {}
        sim_info: dict[str, Any] = {}
        for name, key, ex, rec in runs:
            _, oracle = parse_policy(name)
            with tqdm(total=requests, desc=f"{key} @ {r:g} req/s", unit="req", leave=False) as bar:
                res = simulate(lists[oracle], key, inst.memory, tm, instances=instances,
                               max_input_tokens=max_input_tokens, max_tokens_limit=max_tokens,
                               params=params, progress=bar.update, headroom=headroom, execution=ex,
                               oom_recovery=rec, max_preemptions=max_preemptions)
            results[key] = res.metrics
            sim_info[key] = {"wall_s": round(res.wall_s, 3), "batches": res.batches,
                             "sim_time_s": res.sim_time_s, **{k: v for k, v in res.extra.items() if k != "params"}}
        config = {"runner": "sim", "workload": wc.to_dict(), "instances": instances,
                  "instance": inst.describe(), "time_model": tm_desc, "policy_params": params,
                  "max_input_tokens": max_input_tokens, "headroom": headroom, "rate": r,
                  "execution": modes, "oom_recovery": oom_recovery, "max_preemptions": max_preemptions,
                  "sim": sim_info}
        by_rate[f"{r:g}"] = {"config": config, "policies": results}
        typer.echo(f"\nrate {r:g} req/s, {requests} requests, {instances} instances, predictor {predictor}")
        typer.echo(ratio_table(results, base_key(results), versus))
    last = by_rate[f"{rates[-1]:g}"]
    out: dict[str, Any] = {"config": last["config"], "policies": last["policies"]}
    if len(rates) > 1:
        out["by_rate"] = by_rate
    _write(out, json_out, plot)


@app.command()
def live(
    url: str = typer.Option("http://127.0.0.1:8000", help="Gateway base URL (loopback only)."),
    label: str = typer.Option("live", help="Name for this run in the JSON (the server's COHORT_POLICY)."),
    data: list[Path] = typer.Option(None, help="Shared-data JSONL files (repeat); default: the 8 Magnus tasks."),
    rate: str = typer.Option("2", help="Request rate(s), comma-separated for a sweep."),
    requests: int = typer.Option(200, help="Requests per rate."),
    seed: int = typer.Option(0),
    json_out: Path = typer.Option(None, "--json"),
    plot: Path = typer.Option(None),
    max_tokens: int = typer.Option(64, help="max_tokens per request; emulated lengths are capped here."),
    batch_time: Path = typer.Option(None, help="Profiled samples JSON for the SLO rule's solo times "
                                               "(default: AnalyticBatchTime's tiny-CPU-model coefficients)."),
    slo_k_min: float = typer.Option(2.0),
    slo_k_max: float = typer.Option(20.0),
    max_in_flight: int = typer.Option(256, help="Most requests outstanding at once."),
    request_timeout_s: float = typer.Option(300.0),
    time_limit_s: float = typer.Option(600.0, help="Stop the whole run after this long (per rate)."),
    merge: Path = typer.Option(None, help="Add this run to an existing results JSON (one policy per server run)."),
    spawn: str = typer.Option(None, help="Comma-separated policies: start a fresh local stack for each "
                                         "(embedded Redis, SQLite) and replay the same workload on all."),
    server_env: list[str] = typer.Option(None, help="KEY=VALUE for the spawned stacks (repeat), e.g. "
                                                    "COHORT_PREDICTOR_DIR=var/models/magnus-bench."),
    workdir: Path = typer.Option(Path("var/bench/live"), help="Where spawned stacks keep their files and logs."),
) -> None:
    """Replay the workload over HTTP against a running stack (COHORT_EMULATE_LENGTHS=true), or with
    --spawn against a fresh local stack per policy, all in one run."""

    targets = [p.strip() for p in spawn.split(",") if p.strip()] if spawn else [label]
    if spawn and any("+" in t for t in targets):
        raise typer.BadParameter("live runs use the server's predictor; +oracle exists only in `bench sim`")
    # a spawned run name may pick the execution mode: magnus@static (the papers), magnus@elastic
    extra_env = parse_env(server_env)
    if not spawn:
        check_loopback(url)
    files = _files(data)
    if batch_time:
        tm = fitted_time_model(batch_time)
    else:
        tm = AnalyticBatchTime()
    rows = build_rows(files, None)
    by_rate: dict[str, Any] = {}
    rates = _floats(rate)
    for r in rates:
        wc = WorkloadConfig(files=files, requests=requests, rate=r, seed=seed, max_tokens=max_tokens,
                            predictor=None, slo_k_min=slo_k_min, slo_k_max=slo_k_max)
        wl = make_workload(wc, tm, rows)
        cfg = {"runner": "live", "url": None if spawn else url, "workload": wc.to_dict(), "rate": r,
               "server_env": extra_env, "live": {}}
        results: dict[str, Any] = {}
        for name in targets:
            ctx = spawned_stack(name, extra_env, workdir) if spawn else nullcontext(url)
            with ctx as target_url, tqdm(total=requests, desc=f"{name} @ {r:g} req/s", unit="req") as bar:
                res = run_live_sync(wl, target_url, max_in_flight=max_in_flight,
                                    request_timeout_s=request_timeout_s, time_limit_s=time_limit_s,
                                    progress=bar.update)
            results[name] = res.metrics
            cfg["live"][name] = {"wall_s": round(res.wall_s, 2), "errors": res.errors, "batches": res.batches}
            typer.echo(f"\n{name}: rate {r:g} req/s, {requests} requests; errors {res.errors}")
        by_rate[f"{r:g}"] = {"config": cfg, "policies": results}
        typer.echo(ratio_table(results, base_key(results)))
    last = by_rate[f"{rates[-1]:g}"]
    out: dict[str, Any] = {"config": last["config"], "policies": last["policies"]}
    if len(rates) > 1:
        out["by_rate"] = by_rate
    if merge and merge.exists():
        prev = json.loads(merge.read_text())
        prev.setdefault("policies", {}).update(out["policies"])
        prev.setdefault("config", {}).setdefault("live", {}).update(out["config"]["live"])
        for k, v in (out.get("by_rate") or {}).items():
            prev.setdefault("by_rate", {}).setdefault(k, {"config": v["config"], "policies": {}})
            prev["by_rate"][k]["policies"].update(v["policies"])
        out = prev
        typer.echo(ratio_table(out["policies"], base_key(out["policies"])))
    _write(out, json_out or merge, plot)


@app.command()
def chaos(
    experiments: str = typer.Option(",".join(EXPERIMENTS), help=f"Comma-separated: {', '.join(EXPERIMENTS)}."),
    requests: int = typer.Option(40, help="Requests in flight during a kill or a Redis restart."),
    workdir: Path = typer.Option(Path("var/bench/chaos"), help="Where the stacks keep their files and logs."),
    json_out: Path = typer.Option(None, "--json"),
) -> None:
    """Failure experiments on fresh local stacks: worker/batcher kill -9, Redis restart with and
    without persistence, a burst over the queue limit, clients that leave, hostile inputs. Prints
    sent / answered / explicit errors / lost / duplicated per experiment."""
    names = [e.strip() for e in experiments.split(",") if e.strip()]
    unknown = sorted(set(names) - set(EXPERIMENTS))
    if unknown:
        raise typer.BadParameter(f"unknown experiments {unknown}; choose from {list(EXPERIMENTS)}")
    cols = ("sent", "answered", "explicit_errors", "lost", "duplicated", "server_errors_5xx", "records_disagree")
    typer.echo(f"{'experiment':<20}" + "".join(f"{c:>18}" for c in cols))

    def show(o: Outcome) -> None:
        typer.echo(f"{o.experiment:<20}" + "".join(f"{getattr(o, c):>18}" for c in cols)
                   + (f"   {o.notes}" if o.notes else ""))

    results = run_all(names, workdir, requests, progress=show)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps({"experiments": results}, indent=2))
