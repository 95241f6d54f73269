"""`cohort bench fleet`: N simulated engines (``cohort engine-sim serve``), one seeded workload,
replayed against the engines reached directly (the client routes: ``rr`` round-robin, ``ll``
least-loaded; engines FCFS or started with priority scheduling, unused) and against cohort in
front of all N (``COHORT_UPSTREAMS``, engines with priority scheduling). Every target and load
gets fresh engines (and a fresh stack), so no prefix cache or learnt state carries over. Times
are model seconds (``--speedup``); ratios are to ``rr-fcfs``. docs/fleet.md is the user's page.
"""

from __future__ import annotations

import asyncio
import json
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import typer
from tqdm import tqdm

from bench.chat_prefix import ChatPrefixConfig, make_chat_prefix_workload, prefix_stats
from bench.engine_sim.roofline_steps import roofline_step_time
from bench.fleet_bench import (
    BASE,
    HELD_LATE_SHARE,
    SOLO,
    EngineSpec,
    check_targets,
    direct_target,
    engine_fleet,
    fleet_cohort_body,
    fleet_direct_body,
    ratios_to,
    replay_routed,
    scrape,
    spread,
    summary,
    to_model,
    to_wall,
)
from bench.fleet_bound import solo_result
from bench.front_bench import CpuMeter, cohort_processes
from bench.live_stack import parse_env, spawned_stack
from bench.report import pyplot
from bench.roofline import instance
from bench.upstream_bench import per_request, served_model
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files

WORKLOADS = ("magnus", "chat")
CAPACITY_BURST = 3  # the capacity burst's requests, in runs' requests
RATIO_KEYS = ("throughput_rps", "goodput_rps", "mean_latency_s", "p50_latency_s", "p99_latency_s", "mean_ttft_s",
              "p99_ttft_s", "mean_itl_s", "prefix_hit_rate")
PLOT_KEYS = (("mean_latency_s", True), ("p50_latency_s", True), ("p99_latency_s", True), ("goodput_rps", False),
             ("throughput_rps", False), ("prefix_hit_rate", False))


def labels(targets: list[str], repeats: int) -> list[tuple[str, str]]:
    """(label, target) per run: each target ``repeats`` times in a row, the k-th labelled ``t#k``."""
    return [(t if k == 0 else f"{t}#{k + 1}", t) for t in targets for k in range(repeats)]


def _plot(by_load: dict[str, dict[str, Any]], ratios: dict[str, Any], path: Path, title: str) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(PLOT_KEYS), figsize=(3.6 * len(PLOT_KEYS), 4.2))
    loads = list(by_load)
    targets = list(next(iter(by_load.values())))
    width = 0.8 / max(1, len(targets))
    for ax, (key, as_ratio) in zip(axes, PLOT_KEYS, strict=True):
        for j, t in enumerate(targets):
            vals = [(ratios[lo][t].get(key) if as_ratio else by_load[lo][t].get(key)) or 0.0 for lo in loads]
            ax.bar([i + j * width for i in range(len(loads))], vals, width, label=t)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(loads))], loads)
        ax.set_title(f"{key} / {BASE}" if as_ratio else key, fontsize=9)
        if as_ratio:
            ax.axhline(1.0, color="grey", lw=0.6)
    axes[0].legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def fleet(
    engines: int = typer.Option(4, min=1, help="Simulated engines in the fleet."),
    gpu: str = typer.Option("h100-80gb", help="Each engine's roofline GPU preset."),
    model: str = typer.Option("llama-3-8b", help="Each engine's roofline model preset."),
    num_gpu_blocks: int = typer.Option(None, help="KV blocks of 16 tokens per engine (a KV-bound run); default: "
                                       "the roofline's."),
    max_num_seqs: int = typer.Option(256, help="Each engine's max_num_seqs."),
    speedup: float = typer.Option(1.0, help="Engines run this many times faster than wall time (below 1: slower, "
                                  "for a box that cannot carry the fleet's traffic); arrivals are scaled by it and "
                                  "every time is reported in model seconds."),
    workload: str = typer.Option("magnus", help="magnus (the 8 Magnus tasks) | chat (the chat-prefix trace)."),
    burst: bool = typer.Option(False, help="One load only: every request within 1.5 model seconds."),
    targets: str = typer.Option("rr-fcfs,ll-fcfs,rr-prio,ll-prio,magnus,spf", help="Comma-separated: rr-fcfs, "
                                "ll-fcfs, rr-prio, ll-prio (direct; prio: engines with priority scheduling, unused) "
                                "or a cohort policy run name (cohort in front, engines with priority scheduling)."),
    loads: str = typer.Option("0.5,0.9,1.2", help="Offered loads as fractions of the fleet's capacity."),
    capacity: float = typer.Option(0.0, help="The fleet's capacity in model req/s; 0: measure it first: the "
                                   "saturated rate (bench.fleet_bench.saturated_rps) of a burst of 3 x --requests "
                                   "against rr-fcfs."),
    requests: int = typer.Option(200, help="Requests per run."),
    repeats: int = typer.Option(1, min=1, help="Runs of each target per load (labelled t, t#2, …)."),
    seed: int = typer.Option(0),
    max_tokens: int = typer.Option(256, help="The client's bound; true lengths are capped here."),
    systems: int = typer.Option(32, help="chat: distinct system prompts."),
    server_env: list[str] = typer.Option(None, help="KEY=VALUE for the spawned cohort stacks (repeat)."),
    workdir: Path = typer.Option(Path("var/bench/fleet")),
    json_out: Path = typer.Option(None, "--json"), plot: Path = typer.Option(None),
) -> None:
    """A fleet of simulated engines: direct (rr / ll routing, FCFS or priority engines) against
    cohort in front of all of them; ratios to rr-fcfs, the engines' own counters."""
    if workload not in WORKLOADS:
        raise typer.BadParameter(f"--workload must be one of {WORKLOADS}")
    names = [t.strip() for t in targets.split(",") if t.strip()]
    env = parse_env(server_env)
    inst = instance(gpu, model)
    tm = inst.time_model()
    max_len = min(8192, (num_gpu_blocks - 1) * 16) if num_gpu_blocks else 8192
    spec = EngineSpec(gpu=gpu, model=model, num_gpu_blocks=num_gpu_blocks, max_num_seqs=max_num_seqs,
                      max_model_len=max_len, speedup=speedup)
    files = [str(p) for p in data_files()]
    rows = build_rows(files, None) if workload == "magnus" else None

    def make(rate: float, n: int = requests):
        if workload == "magnus":
            return make_workload(WorkloadConfig(files=files, requests=n, rate=rate, seed=seed, max_tokens=max_tokens),
                                 tm, rows)
        return make_chat_prefix_workload(ChatPrefixConfig(requests=n, rate=rate, seed=seed, max_tokens=max_tokens,
                                                          n_system_prompts=systems,
                                                          max_prompt_tokens=max_len - max_tokens), tm)

    def run(label: str, target: str, wl, tag: str) -> dict[str, Any]:
        """One run on fresh engines (and a fresh cohort stack): the summary in model time, the
        engines' counters."""
        direct = direct_target(target)
        policy = direct[1] if direct else "priority"
        folder = workdir / tag / label.replace("#", "_").replace(":", "_")
        t0 = time.time()
        with engine_fleet(engines, spec, policy, folder / "engines") as urls:
            stack = nullcontext(None) if direct else spawned_stack(target, {**env, "COHORT_UPSTREAMS": ",".join(urls)},
                                                                    folder)
            with stack as url:
                bases = urls if direct else [f"{url}/v1"]
                body = fleet_direct_body(wl, spec.model_name) if direct else \
                    fleet_cohort_body(wl, served_model(f"{url}/v1"), speedup)
                meter = None if direct else CpuMeter(cohort_processes())  # the front's own share of the box
                if meter is not None:
                    meter.start()
                with tqdm(total=len(wl), desc=f"{label} @ {tag}", unit="req", leave=False, disable=None) as bar:
                    res, where = asyncio.run(replay_routed(to_wall(wl, speedup), bases, body,
                                                           direct[0] if direct else "rr", progress=bar.update))
                used = meter.stop() if meter is not None else None
            eng = scrape(urls)
        res = to_model(res, speedup)
        m = summary(wl, res)
        m["per_request"] = per_request(res)  # paired comparisons: request i is the same in every run
        m["prefix_hit_rate"] = eng["prefix_hit_rate"]
        m["preemptions"] = eng["preemptions"]
        m["late_step_share"] = eng["late_step_share"]
        m["engines"] = eng
        m["run_wall_s"] = round(time.time() - t0, 1)
        if used is not None:  # cores the front's processes (gateway, batcher, upstream workers, Redis) kept busy
            wall = used.pop("wall")
            used.pop("client")
            m["front_cores"] = {role: s / wall for role, s in used.items()}
        if direct:
            m["requests_per_engine"] = [where.count(k) for k in range(engines)]
        return m

    measured = None
    if capacity <= 0:  # a longer burst: the fleet runs full for most of it, not ramping up or draining
        wl = make(CAPACITY_BURST * requests / 1.5, CAPACITY_BURST * requests)
        measured = run(BASE, BASE, wl, "capacity")
        capacity = measured["saturated_rps"]
    typer.echo(f"fleet capacity: {capacity:.2f} model req/s ({capacity * speedup:.2f} wall req/s at speedup "
               f"{speedup:g})")
    solo_steps = roofline_step_time(gpu, model)
    fracs = ["burst"] if burst else [f"{float(x):g}" for x in loads.split(",") if x.strip()]
    by_load: dict[str, dict[str, Any]] = {lo: {} for lo in fracs}
    trace = None
    workloads: dict[str, dict[str, list]] = {}  # each load's requests, for the runs' per-request times
    for lo in fracs:
        wl = make(requests / 1.5 if lo == "burst" else max(0.01, float(lo) * capacity))
        workloads[lo] = {"arrival_s": [round(float(x), 5) for x in wl.arrival],
                         "prompt_tokens": [int(x) for x in wl.input_tokens],
                         "true_tokens": [int(x) for x in wl.true_tokens], "slo_s": [float(x) for x in wl.slo_s]}
        if workload == "chat" and trace is None:
            trace = prefix_stats(wl)
        for label, target in labels(names, repeats):
            by_load[lo][label] = m = run(label, target, wl, f"load-{lo}")
            typer.echo(f"  {lo:>5} {label:>10}: {m['throughput_rps']:7.2f} req/s, e2e mean/p50/p99 "
                       f"{m['mean_latency_s']:.3f}/{m['p50_latency_s']:.3f}/{m['p99_latency_s']:.3f} s, TTFT mean "
                       f"{m['mean_ttft_s']:.3f} s, goodput {m['goodput_rps']:.2f}, hit {m['prefix_hit_rate']:.3f}, "
                       f"preempt {m['preemptions']:g}, late steps {100 * m['late_step_share']:.1f} %, lost "
                       f"{m['lost']} ({m['run_wall_s']:g} s)"
                       + (f", front {sum(m['front_cores'].values()):.2f} cores" if "front_cores" in m else ""))
        solo = solo_result(wl, solo_steps, max_tokens)  # what no target can beat
        by_load[lo][SOLO] = m = summary(wl, solo)
        m.update(prefix_hit_rate=0.0, preemptions=0, per_request=per_request(solo))  # the hit rate: not bounded
    ratios = {lo: ratios_to(runs, BASE, RATIO_KEYS) for lo, runs in by_load.items()}
    checks = {lo: {t: check_targets(runs, t, workload) for t in runs if t != SOLO and not direct_target(t)}
              for lo, runs in by_load.items() if BASE in runs}  # no ratios without the base run
    spreads = {lo: {t: {k: spread([runs[lb][k] for lb, tt in labels(names, repeats) if tt == t])
                        for k in ("mean_latency_s", "p50_latency_s", "p99_latency_s", "throughput_rps",
                                  "goodput_rps")} for t in names} for lo, runs in by_load.items()} \
        if repeats > 1 else None
    config = {"engines": engines, "gpu": gpu, "model": model, "instance": inst.describe(),
              "num_gpu_blocks": num_gpu_blocks, "max_num_seqs": max_num_seqs, "max_model_len": max_len,
              "speedup": speedup, "times": "model seconds (wall seconds x speedup)", "workload": workload,
              "burst": burst, "targets": names, "loads": fracs, "capacity_model_rps": capacity,
              "capacity_burst": measured, "requests": requests, "repeats": repeats, "seed": seed,
              "max_tokens": max_tokens, "server_env": env, "trace": trace,
              "direct_stream_interval": 8}
    out = {"config": config, "by_load": by_load, "workloads": workloads, "ratios_to": BASE, "ratios": ratios, "targets": checks,
           "repeat_spread": spreads}
    typer.echo(f"\n{engines} engines ({gpu}, {model}, {num_gpu_blocks or 'roofline'} blocks), {workload}, speedup "
               f"{speedup:g}: times in model seconds, ratios to {BASE}")
    for lo, runs in by_load.items():
        typer.echo(f"load {lo}" + ("" if lo == "burst" else f" ({float(lo) * capacity:.1f} model req/s)"))
        if BASE not in runs:
            typer.echo(f"  no {BASE} run: no ratios, no target checks")
            continue
        for t in runs:
            r = ratios[lo][t]
            typer.echo(f"  {t:>10}: mean x{r['mean_latency_s'] or 0:.2f}, p50 x{r['p50_latency_s'] or 0:.2f}, p99 "
                       f"x{r['p99_latency_s'] or 0:.2f}, goodput x{r['goodput_rps'] or 0:.2f}, throughput "
                       f"x{r['throughput_rps'] or 0:.2f}, TTFT x{r['mean_ttft_s'] or 0:.2f}"
                       + ("" if t == SOLO else f", hit rate {runs[t]['prefix_hit_rate']:.3f}"))
        for t, cs in checks[lo].items():
            if cs:
                typer.echo(f"  targets {t}: " + ", ".join(
                    f"{c['metric']} {c['ratio'] if c['ratio'] is None else round(c['ratio'], 2)} {c['bound']} "
                    f"{'met' if c['met'] else 'NOT met'}"
                    + ("" if "best_possible" not in c else f" (best possible {c['best_possible']:.2f}"
                       + ("" if c["reachable"] else ": unreachable") + ")") for c in cs))
    late = max((m.get("late_step_share", 0.0) for runs in by_load.values() for m in runs.values()), default=0.0)
    out["held_model_clock"] = late <= HELD_LATE_SHARE
    typer.echo(f"speedup {speedup:g}: " + (f"the engines kept their model clock (at most {100 * late:.1f} % of steps "
                                            "late); whether cohort's front kept up, a run at a lower --speedup tells"
                                            if late <= HELD_LATE_SHARE else
                                            f"the engines did NOT keep their model clock (up to {100 * late:.1f} % of a "
                                            "run's steps late): this box does not hold this fleet; lower --speedup"))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(out, indent=2, default=float))
    if plot:
        _plot(by_load, ratios, plot, f"{engines} x {gpu} / {model}, {num_gpu_blocks or 'roofline'} blocks, "
              f"{workload}, speedup {speedup:g} (model time)")
