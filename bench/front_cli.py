"""`cohort bench front`: what a front costs in front of an engine that computes nothing — the engine
direct, a bare Python streaming proxy (the floor), cohort with one or N gateway processes, and the
LiteLLM proxy where it is installed — in front CPU per request by process, added TTFT, e2e against
direct, and the requests per second one front core serves in a closed loop. The rig is
``bench.front_bench``'s."""

from __future__ import annotations

import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager
from datetime import date
from pathlib import Path
from typing import Any

import psutil
import typer
from tqdm import tqdm

from bench.front_bench import (
    CpuMeter,
    against_direct,
    closed_loop,
    cohort_processes,
    fixed_delay_engines,
    measure,
    pinned,
)
from bench.live_stack import parse_env, spawned_stack
from bench.upstream_bench import direct_body, replay_streams, served_model
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime
from procstack.stack import free_port, wait_until_ok


@contextmanager
def _front_process(role: str, cmd: list[str], env: dict[str, str], port: int, health_path: str,
                   workdir: Path) -> Iterator[tuple[str, dict]]:
    """A front that is one process (LiteLLM, the bare proxy), started and ready: its URL and its
    process, stopped however the run ends."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"{role}.log"
    proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env=env)

    def alive() -> None:
        if proc.poll() is not None:
            raise RuntimeError(f"{role} exited: {log.read_text()[-2000:]}")

    try:
        if not wait_until_ok(f"http://127.0.0.1:{port}{health_path}", 180.0, alive):
            raise TimeoutError(f"{role} did not start: {log.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{port}/v1", {role: [psutil.Process(proc.pid)]}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


def _litellm(binary: Path, engine: str, model: str, workdir: Path) -> AbstractContextManager[tuple[str, dict]]:
    """The LiteLLM proxy (one worker) routing ``model`` to the engine."""
    workdir.mkdir(parents=True, exist_ok=True)
    cfg = workdir / "litellm.yaml"
    cfg.write_text(f"model_list:\n  - model_name: {model}\n    litellm_params:\n      model: openai/{model}\n"
                   f"      api_base: {engine}\n      api_key: none\n")
    port = free_port()
    # loopback only, no key: the client sends none, as to the engine and to cohort
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_DANGEROUSLY_PERMIT_WEAK_OR_UNSET_MASTER_KEY": "true"}
    cmd = [str(binary), "--config", str(cfg), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"]
    return _front_process("litellm", cmd, env, port, "/health/liveliness", workdir)


def _proxy(engine: str, workdir: Path) -> AbstractContextManager[tuple[str, dict]]:
    """The bare streaming proxy (``bench.front_proxy``): the floor any Python front pays."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.front_proxy", "--engine", engine, "--port", str(port)]
    return _front_process("proxy", cmd, dict(os.environ), port, "/health", workdir)


# cohort's targets: who streams the engine's tokens to the client
FRONT_MODES = {"cohort": "gateway", "cohort-relay": "worker"}


def _run_target(label: str, wls: dict[str, Any], warm, closed, base_url: str, model: str, roles: dict,
                concurrency: int) -> dict[str, Any]:
    """A warm-up (lazy loads, connection pools), every offered rate, then the closed loop, against one
    front (or the engine direct)."""
    front = [r for r in roles if roles[r]]
    meter = CpuMeter(roles)
    asyncio.run(replay_streams(warm, base_url, direct_body(warm, model)))
    out: dict[str, Any] = {"rates": {}}
    for rate, wl in wls.items():
        with tqdm(total=len(wl), desc=f"{label} @ {rate} req/s", unit="req") as bar:
            meter.start()
            res = asyncio.run(replay_streams(wl, base_url, direct_body(wl, model), progress=bar.update))
            out["rates"][rate] = measure(wl, res, meter.stop(), front)
    meter.start()
    res = asyncio.run(closed_loop(closed, base_url, direct_body(closed, model), concurrency))
    out["closed_loop"] = measure(closed, res, meter.stop(), front)
    return out


def front(
    targets: str = typer.Option("direct,proxy,cohort-relay,cohort,cohort:2,litellm,direct", help="Comma-separated: "
                                "direct (the engine itself), proxy (a bare Python streaming proxy: the floor any "
                                "Python front pays), cohort (the gateway streams from the engine), cohort-relay "
                                "(the upstream worker streams, tokens through Redis), either with :N gateway "
                                "processes, litellm (needs --litellm). Ratios and added TTFT are to the first direct."),
    rates: str = typer.Option("30,80", help="Offered requests/s (Poisson), each a replay of --requests."),
    requests: int = typer.Option(600), seed: int = typer.Option(0),
    ttft_ms: float = typer.Option(20.0, help="The engine's first token after this many ms."),
    itl_ms: float = typer.Option(10.0, help="Then one token every this many ms."),
    max_tokens: int = typer.Option(64, help="True lengths are capped here; each request asks for exactly its "
                                   "length (ignore_eos), the same body for every target."),
    concurrency: int = typer.Option(256, help="Clients of the closed loop. Enough that the front, not the clients, "
                                    "is the limit: n clients of requests lasting t s send at most n/t req/s (64 "
                                    "clients of this workload's ~0.36 s streams cap the loop near 180 req/s)."),
    closed_requests: int = typer.Option(2400, help="Requests of the closed loop."),
    client_cores: str = typer.Option("0", help="Cores of the engine and the client."),
    front_cores: str = typer.Option("1", help="Cores of the front under test."),
    litellm: Path = typer.Option(None, help="The `litellm` command of a venv that has litellm[proxy]."),
    server_env: list[str] = typer.Option(None, help="KEY=VALUE for the spawned cohort stacks (repeat)."),
    data: list[Path] = typer.Option(None, help="Shared-data JSONL files (default: the 8 Magnus tasks)."),
    workdir: Path = typer.Option(Path("var/bench/front")),
    json_out: Path = typer.Option(None, "--json"), plot: Path = typer.Option(None),
) -> None:
    """Front CPU per request, added TTFT and closed-loop capacity of cohort (and LiteLLM) in front of a
    zero-compute engine; the engine and client on one core, the front on another."""
    files = [str(p) for p in (data or data_files())]
    rows = build_rows(files, None)

    def workload(rate: float, n: int):
        return make_workload(WorkloadConfig(files=files, requests=n, rate=rate, seed=seed, max_tokens=max_tokens),
                             AnalyticBatchTime(), rows)

    client = {int(c) for c in client_cores.split(",")}
    fronts = {int(c) for c in front_cores.split(",")}
    names = [t.strip() for t in targets.split(",") if t.strip()]
    if "litellm" in names and litellm is None:
        typer.echo("litellm: no --litellm command given; that target is left out")
        names = [t for t in names if t != "litellm"]
    wls = {f"{float(r):g}": workload(float(r), requests) for r in rates.split(",") if r.strip()}
    closed = workload(1000.0, closed_requests)
    warm = workload(50.0, 100)
    env = parse_env(server_env)
    for t in names:
        head, _, n = t.partition(":")
        if not (t in ("direct", "litellm", "proxy") or (head in FRONT_MODES and (n == "" or n.isdigit() and int(n) >= 1))):
            raise typer.BadParameter(f"unknown target {t!r}: direct, proxy, cohort[:N], cohort-relay[:N] or litellm")
    os.sched_setaffinity(0, client)  # this thread is the client; what it starts inherits its cores
    runs: dict[str, Any] = {}
    with fixed_delay_engines(1, ttft_ms, itl_ms, workdir) as [(_, engine)]:  # stopped however the runs end
        model = served_model(engine)
        for i, target in enumerate(names):
            label = target if target not in runs else f"{target}#{i + 1}"
            with ExitStack() as held:
                if target == "direct":
                    url, served, roles = engine, model, {}
                elif target in ("proxy", "litellm"):
                    one = _proxy(engine, workdir / target) if target == "proxy" else \
                        _litellm(litellm, engine, model, workdir / target)
                    with pinned(fronts):  # the front's process starts on its cores; the client stays
                        url, roles = held.enter_context(one)
                    served = model
                else:
                    head, _, n = target.partition(":")
                    stack_env = {**env, "COHORT_UPSTREAMS": engine, "COHORT_GATEWAY_PROCESSES": n or "1",
                                 "COHORT_UPSTREAM_STREAMING": FRONT_MODES[head]}
                    with pinned(fronts):
                        stack_url = held.enter_context(
                            spawned_stack("magnus", stack_env, workdir / label.replace(":", "_")))
                    url, roles = f"{stack_url}/v1", cohort_processes()
                    served = served_model(url)
                runs[label] = _run_target(label, wls, warm, closed, url, served, roles, concurrency)
    base = next((lb for lb in runs if lb.startswith("direct")), None)
    for run in runs.values():
        for rate, m in run["rates"].items():
            m["vs_direct"] = against_direct(m, runs[base]["rates"][rate]) if base else None
    config = {"targets": names, "rates": list(wls), "requests": requests, "seed": seed, "ttft_ms": ttft_ms,
              "itl_ms": itl_ms, "max_tokens": max_tokens,
              "mean_tokens": float(next(iter(wls.values())).true_tokens.mean()), "concurrency": concurrency,
              "closed_requests": closed_requests, "client_cores": sorted(client), "front_cores": sorted(fronts),
              "server_env": env, "files": files, "day": date.today().isoformat(), "machine": platform.processor()
              or platform.machine(), "cpus": os.cpu_count(), "started": time.time()}
    out = {"config": config, "ratios_to": base, "runs": runs}
    _print(runs)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(out, indent=2, default=float))
    if plot:
        _plot(runs, plot)


def _print(runs: dict[str, Any]) -> None:
    for lb, run in runs.items():
        for rate, m in run["rates"].items():
            vs = m.get("vs_direct") or {}
            typer.echo(f"{lb:>12} @ {rate:>4} req/s: done {m['throughput_rps']:6.1f} req/s, front CPU "
                       f"{m['front_cpu_ms_per_request']:5.2f} ms/req {_roles(m)}, TTFT p50 {1000 * m['p50_ttft_s']:.1f}"
                       f" p99 {1000 * m['p99_ttft_s']:.1f} ms (added {vs.get('added_ttft_p50_ms', 0):+.1f} / "
                       f"{vs.get('added_ttft_p99_ms', 0):+.1f}), mean e2e {m['mean_latency_s']:.3f} s "
                       f"(x{vs.get('mean_e2e_ratio', 1):.3f}), lost {m['lost']}")
        m = run["closed_loop"]
        typer.echo(f"{lb:>12} closed loop: {m['throughput_rps']:6.1f} req/s, front CPU "
                   f"{m['front_cpu_ms_per_request']:5.2f} ms/req {_roles(m)}, front cores busy {m['front_core_busy']:.2f}"
                   f", lost {m['lost']}")


def _roles(m: dict[str, Any]) -> str:
    parts = [f"{r} {v:.2f}" for r, v in m["cpu_ms_per_request"].items() if r != "client"]
    return f"({', '.join(parts)})" if parts else ""


def _plot(runs: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fronts = [lb for lb in runs if not lb.startswith("direct")]
    rates = list(next(iter(runs.values()))["rates"])
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    roles = sorted({r for lb in fronts for m in runs[lb]["rates"].values() for r in m["cpu_ms_per_request"]
                    if r != "client"})
    colors = {role: f"C{i}" for i, role in enumerate(roles)}  # a role's colour at every rate (lighter: later rates)
    for k, rate in enumerate(rates):
        bottom = [0.0] * len(fronts)
        for role in roles:
            vals = [runs[lb]["rates"][rate]["cpu_ms_per_request"].get(role, 0.0) for lb in fronts]
            xs = [i + 0.4 * k for i in range(len(fronts))]
            axes[0].bar(xs, vals, 0.38, bottom=bottom, color=colors[role], alpha=1.0 if k == 0 else 0.55,
                        label=role if k == 0 else None)
            bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[0].set_xticks([i + 0.2 for i in range(len(fronts))], fronts)
    axes[0].set_ylabel(f"front CPU ms per request (bars: {', '.join(rates)} req/s)")
    axes[0].legend(fontsize=8)
    for lb in fronts:
        added = [runs[lb]["rates"][r]["vs_direct"]["added_ttft_p50_ms"] for r in rates]
        p99 = [runs[lb]["rates"][r]["vs_direct"]["added_ttft_p99_ms"] for r in rates]
        axes[1].plot([float(r) for r in rates], added, marker="o", label=f"{lb} p50")
        axes[1].plot([float(r) for r in rates], p99, marker="x", linestyle="--", label=f"{lb} p99")
    axes[1].set_xlabel("offered req/s")
    axes[1].set_ylabel("added TTFT vs direct (ms)")
    axes[1].set_yscale("symlog")
    axes[1].legend(fontsize=8)
    labels = list(runs)
    axes[2].bar(labels, [runs[lb]["closed_loop"]["throughput_rps"] for lb in labels])
    axes[2].set_ylabel("closed loop: requests/s")
    for ax in axes:
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
