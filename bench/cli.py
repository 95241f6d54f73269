"""`cohort bench ...`: run the batching policies on one workload, in the simulator or live.

``cohort bench sim`` simulates N instances (default: Magnus's testbed, ChatGLM-6B fp16 on a V100-32GB,
roofline batch times) for every policy on the *same* seeded workload; ``cohort bench live`` replays that
workload against a running stack. Both write ``{"config": {...}, "policies": {name: {metrics}}}``; with several rates, the top level holds the
last rate and ``by_rate`` holds every rate. A table of ratios against ``vs`` goes to stdout and
``--plot DIR`` draws throughput and latency against rate, one line per policy.

``bench sim`` compares execution modes side by side: ``--execution static,elastic`` runs every
policy under both, or a name carries its own, ``magnus@static`` (the paper) next to
``magnus@elastic``; keys in the JSON are ``POLICY[+oracle]@EXECUTION`` (``bench.simulator.parse_run``).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm

from batcher.policies.spf import DEFAULT_AGING
from bench.batch_job import PHASES as BATCH_PHASES
from bench.batch_job import run_batch_bench as run_batch_job
from bench.chaos import EXPERIMENTS, Outcome, run_all
from bench.continuous import EngineLimits
from bench.continuous_run import (
    CB_FCFS,
    DEFAULT_GROUP_FRAC,
    DEFAULT_MARGINAL_COST,
    DEFAULT_MAX_ROWS,
    physical_bound,
)
from bench.fleet_cli import fleet
from bench.front_cli import front
from bench.live import answer_digests, check_loopback, compare_answers, run_live_sync
from bench.live_stack import parse_env, spawned_stack
from bench.online_quantile import OnlineQuantile
from bench.prefix_cli import prefix
from bench.report import base_key, ratio_table, write_result
from bench.roofline import Instance, fitted_time_model, instance
from bench.simulator import DEFAULT_THRESHOLD, parse_policy, parse_run, simulate
from bench.soak_cli import soak
from bench.upstream_cli import upstream
from bench.workload import ORACLE, WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from cohort.settings import Settings
from predictor.conformal import ConformalTable
from predictor.estimator import AnalyticBatchTime

app = typer.Typer(help="Benchmarks: simulate or replay the policies on one workload.", no_args_is_help=True)
for _command in (soak, upstream, prefix, front, fleet):  # `cohort bench soak|upstream|prefix|front|fleet`: bench/<name>_cli.py
    app.command()(_command)
DEFAULT_POLICIES = "vs,glp,abp,magnus,magnus+oracle,s3,slo-dbs,odbs,slo-odbs"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _files(data: list[Path] | None) -> list[str]:
    return [str(p) for p in (data or data_files())]


def _instance(gpu: str, model: str, theta_bytes: int | None, reserve_frac: float, step_overhead_s: float
              ) -> Instance:
    return instance(gpu, model, reserve_frac=reserve_frac, step_overhead_s=step_overhead_s,
                    theta_override=theta_bytes)


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
    group_frac: float = typer.Option(DEFAULT_GROUP_FRAC, help="continuous: share of Θ one admission group is "
                                     "planned with."),
    max_rows: int = typer.Option(DEFAULT_MAX_ROWS, help="continuous: most rows a cohort policy's instance runs at "
                                 "once (COHORT_CONTINUOUS__MAX_ROWS); cb-fcfs keeps vLLM's 256."),
    marginal_cost: float = typer.Option(DEFAULT_MARGINAL_COST, min=0.0, max=1.0, help="continuous: "
                                        "COHORT_CONTINUOUS__MARGINAL_COST for cohort policies (0 = off; batcher.row_cost)."),
    learnt_step_cost: bool = typer.Option(False, help="continuous: price that rule on a step cost learnt from the "
                                          "simulated steps (OnlineStepCost, as a worker does), not the roofline."),
    spf_aging: float = typer.Option(DEFAULT_AGING, help="spf: predicted tokens of rank gained per second waiting."),
    online_quantile: bool = typer.Option(True, help="continuous, with --predictor: plan each arrival with the "
                                         "online recalibrated quantile fed by the simulated completions (the live "
                                         "service's rule); --no-online-quantile: the static q90 table."),
    baseline: bool = typer.Option(True, help="Also run cb-fcfs (vLLM's default scheduler) on the roofline, "
                                  "so every table has its ratio column."),
) -> None:
    """Simulate every policy on the same seeded workload; print ratios vs VS, cb-fcfs and the
    physical bound; write JSON/plots."""
    modes = [x.strip() for x in execution.split(",") if x.strip()]
    try:
        runs = [(name, *run) for p in policies.split(",") if (name := p.strip())
                for run in parse_run(name, modes, oom_recovery)]
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    files = _files(data)
    inst = _instance(gpu, model, theta_bytes, reserve_frac, step_overhead_s)
    if batch_time:
        tm = fitted_time_model(batch_time)
        tm_desc = {"kind": "fitted", "samples": str(batch_time), **tm.to_dict()}
    else:
        tm = inst.time_model()
        tm_desc = tm.to_dict()
        if baseline and CB_FCFS not in [key for _, key, *_ in runs]:
            runs.insert(0, (CB_FCFS, *parse_run(CB_FCFS)[0]))
    names = [name for name, *_ in runs]
    pred = None if predictor == ORACLE else predictor
    needs_pred = any(not parse_policy(n)[1] for n in names)
    if pred is None and needs_pred:
        typer.echo("note: no --predictor: every policy sees true lengths (same as +oracle)", err=True)
    rows = build_rows(files, pred)
    params = {"threshold": threshold, "batch_size": batch_size, "l1": l1, "spf_aging": spf_aging}
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
            online = online_quantile and pred is not None and not oracle and ex == "continuous"
            with tqdm(total=requests, desc=f"{key} @ {r:g} req/s", unit="req", leave=False) as bar:
                res = simulate(lists[oracle], key, inst.memory, tm, instances=instances,
                               max_input_tokens=max_input_tokens, max_tokens_limit=max_tokens,
                               params=params, progress=bar.update, headroom=headroom, execution=ex,
                               oom_recovery=rec, max_preemptions=max_preemptions, group_frac=group_frac, max_rows=max_rows,
                               marginal_cost=marginal_cost, learnt_step_cost=learnt_step_cost,
                               online=OnlineQuantile(ConformalTable.load(pred)) if online else None)
            if not batch_time:
                res.metrics["physical_bound_rps"] = physical_bound(lists[oracle], tm, inst.memory, instances,
                                                                   EngineLimits())
            results[key] = res.metrics
            sim_info[key] = {"wall_s": round(res.wall_s, 3), "batches": res.batches,
                             "sim_time_s": res.sim_time_s, **{k: v for k, v in res.extra.items() if k != "params"}}
        config = {"runner": "sim", "workload": wc.to_dict(), "instances": instances,
                  "instance": inst.describe(), "time_model": tm_desc, "policy_params": params,
                  "max_input_tokens": max_input_tokens, "headroom": headroom,
                  "quantile": "online" if online_quantile and pred is not None else "static", "rate": r, "group_frac": group_frac,
                  "max_rows": max_rows, "marginal_cost": marginal_cost,
                  "step_cost": "learnt" if learnt_step_cost else "roofline",
                  "execution": modes, "oom_recovery": oom_recovery, "max_preemptions": max_preemptions,
                  "sim": sim_info}
        by_rate[f"{r:g}"] = {"config": config, "policies": results}
        typer.echo(f"\nrate {r:g} req/s, {requests} requests, {instances} instances, predictor {predictor}")
        typer.echo(ratio_table(results, base_key(results), versus))
    last = by_rate[f"{rates[-1]:g}"]
    out: dict[str, Any] = {"config": last["config"], "policies": last["policies"]}
    if len(rates) > 1:
        out["by_rate"] = by_rate
    write_result(out, json_out, plot)


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
        answers: dict[str, list[str | None]] = {}
        for name in targets:
            ctx = spawned_stack(name, extra_env, workdir) if spawn else nullcontext(url)
            with ctx as target_url, tqdm(total=requests, desc=f"{name} @ {r:g} req/s", unit="req") as bar:
                res = run_live_sync(wl, target_url, padded_batches=_execution_of(name) != "continuous",
                                    max_in_flight=max_in_flight,
                                    request_timeout_s=request_timeout_s, time_limit_s=time_limit_s,
                                    progress=bar.update)
            results[name] = res.metrics
            ev = res.events
            cfg["live"][name] = {"wall_s": round(res.wall_s, 2), "errors": res.errors, "batches": res.batches,
                                 "evictions": ev.get("preemptions", 0), "swaps": ev.get("swaps", 0),
                                 "recomputes": ev.get("preemptions", 0) - ev.get("swaps", 0)}
            answers[name] = answer_digests(res.texts)
            typer.echo(f"\n{name}: rate {r:g} req/s, {requests} requests; errors {res.errors}; evictions "
                       f"{ev.get('preemptions', 0)} (swapped {ev.get('swaps', 0)})")
        cfg["answer_digests"] = answers
        if len(answers) > 1:
            cfg["answers"] = _echo_answers(answers)
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
        digests = {**prev["config"].get("answer_digests", {}), **out["config"].get("answer_digests", {})}
        if digests:  # the same seeded workload: answers compare across invocations too
            prev["config"]["answer_digests"] = digests
            prev["config"]["answers"] = _echo_answers(digests)
        for k, v in (out.get("by_rate") or {}).items():
            prev.setdefault("by_rate", {}).setdefault(k, {"config": v["config"], "policies": {}})
            prev["by_rate"][k]["policies"].update(v["policies"])
        out = prev
        typer.echo(ratio_table(out["policies"], base_key(out["policies"])))
    write_result(out, json_out or merge, plot)


def _echo_answers(digests: dict[str, list[str | None]]) -> dict[str, Any]:
    """Compare the runs' answers to the same requests and say so."""
    res = compare_answers(digests)
    typer.echo(f"answers: {res['identical']} of {res['compared']} requests answered by every run are identical "
               f"across {', '.join(digests)}")
    return res


def _execution_of(run_name: str) -> str:
    """The execution mode a live run name asks for (``POLICY@EXECUTION``), else the server's default."""
    run_name = run_name.partition(":")[0]
    if "@" in run_name:
        ((_, execution, _),) = parse_run(run_name)
        return execution
    return Settings.model_fields["execution"].default


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


@app.command()
def adaptive(
    json_out: Path = typer.Option(None, "--json", help="Write {\"config\", \"runs\": [...]} here."),
    plot: Path = typer.Option(None, help="PNG of throughput and weighted turnaround (default: beside --json)."),
    requests: int = typer.Option(1000, help="Requests per run (sampled from the validation rows)."),
    max_output: str = typer.Option("64,256", help="Comma-separated maximum output lengths."),
    data: str = typer.Option("alpaca,magnus", help="Comma-separated: alpaca (shared Alpaca rows) | magnus "
                             "(the eight Magnus tasks)."),
    gpu_pages: int = typer.Option(128, help="GPU KV pages of 16 tokens (the paper: 128)."),
    host_pages: int = typer.Option(64, help="Host swap pool pages (the paper: 64)."),
    gpu: str = typer.Option("a800-80gb", help="GPU preset (its PCIe bandwidth prices a swap)."),
    model: str = typer.Option("llama-13b", help="Model preset."),
    max_num_seqs: int = typer.Option(256, help="Most running rows per step."),
    rate: float = typer.Option(0.0, help="Poisson request rate; 0 sends every request at t = 0 (the paper)."),
    seed: int = typer.Option(0),
    chunked_prefill: bool = typer.Option(True, help="cohort's engine (re-prefill inside decode steps); "
                                         "--no-chunked-prefill: vLLM 0.2.5's prefill-only steps (the paper's base)."),
) -> None:
    """AdaptiveLLM's experiment: recompute / swap / adaptive preemption under FCFS and
    adaptive-fair, memory-starved, in the continuous simulator; prints the runs and the targets."""
    from bench.adaptive import plot_adaptive, run_adaptive, target_lines

    outs = [int(x) for x in max_output.split(",") if x.strip()]
    sets = [x.strip() for x in data.split(",") if x.strip()]
    result = run_adaptive(requests, outs, sets, gpu_pages, host_pages, gpu, model, max_num_seqs, rate, seed,
                          progress=lambda s: typer.echo(s, err=True), chunked_prefill=chunked_prefill)
    typer.echo(f"{'data':7s} {'max_out':>7s} {'policy':13s} {'preemption':10s} {'req/s':>8s} {'WT':>7s} "
               f"{'mean lat':>9s} {'swaps':>6s} {'recomp':>6s}")
    for r in result["runs"]:
        typer.echo(f"{r['data']:7s} {r['max_output']:7d} {r['policy']:13s} {r['preemption']:10s} "
                   f"{r['request_throughput']:8.2f} {r['weighted_turnaround']:7.2f} {r['mean_latency_s']:9.2f} "
                   f"{r['swaps']:6d} {r['recomputes']:6d}")
    typer.echo("\n".join(target_lines(result["runs"])))
    write_result(result, json_out, None)
    if plot or json_out:
        c = result["config"]
        title = (f"AdaptiveLLM experiment, simulated: {c['instance']['model']} on {c['instance']['gpu']}, "
                 f"{gpu_pages} GPU pages, {host_pages} host pages, {c['engine']}")
        p = plot_adaptive(result["runs"], plot or json_out.with_suffix(".png"), title)
        typer.echo(f"wrote {p}", err=True)


@app.command("batch-job")
def batch_job(
    rows: int = typer.Option(500, min=1, help="Requests in the job."),
    phases: str = typer.Option("chaos", help=f"Comma-separated, in this order: {', '.join(BATCH_PHASES)}."),
    outstanding: int = typer.Option(128, min=1, help="Rows the job runner keeps in flight (and the interactive "
                                    "phase's concurrency)."),
    min_tokens: int = typer.Option(8, min=1), max_tokens: int = typer.Option(48, min=1),
    seed: int = 0,
    kills: str = typer.Option("0.25:worker,0.45:batch-runner,0.65:gateway",
                              help="FRACTION:PROCESS pairs: SIGKILL the process (and start it again) once that "
                              "fraction of the job's rows is answered (chaos phase); redis: the redis-server."),
    probe_gap_s: float = typer.Option(1.0, help="The probe's gap between interactive requests."),
    probe_s: float = typer.Option(30.0, help="How long the probe runs alone."),
    workdir: Path = typer.Option(Path("var/bench/batch-job")),
    json_out: Path = typer.Option(None, "--json"),
) -> None:
    """A Batch API job on a fresh local stack: through worker, job-runner and gateway
    SIGKILLs, checking every custom_id is answered exactly once; and its throughput and the
    interactive p50 next to it, against the same rows sent as interactive requests."""
    names = [p.strip() for p in phases.split(",") if p.strip()]
    if bad := sorted(set(names) - set(BATCH_PHASES)):
        raise typer.BadParameter(f"unknown phases {bad}; choose from {list(BATCH_PHASES)}")
    plan = {float(f): name for f, _, name in (k.partition(":") for k in kills.split(",") if k.strip())}
    result = run_batch_job(rows, workdir, names, outstanding, min_tokens, max_tokens, seed, plan, probe_gap_s,
                           probe_s, echo=typer.echo)
    typer.echo(json.dumps(result, indent=2))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
    chaos = result.get("chaos")
    if chaos and (chaos["missing"] or chaos["duplicated"] or chaos["status"] != "completed"):
        raise typer.Exit(1)
