"""`cohort bench soak`: the command, its A/B of serving with learning off and on, and its plot
(the soak itself is bench.soak)."""

from __future__ import annotations

import json
import signal
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, get_args

import typer
from tqdm import tqdm

from bench.live_stack import parse_env
from bench.report import pyplot
from bench.soak import SoakConfig, prime_models, run_soak
from cohort.settings import Settings

# name -> (minutes, rate, max_tokens, retrain_at_s): mixes a change is checked against
PRESETS = {"steady": (15.0, 10.0, 32, 90.0)}


def plot_soak(report: dict[str, Any], out: Path) -> Path:
    """Five panels: p50/p99 per window (admin retrains marked), CPU and RSS per process, Redis
    memory, data folder size."""
    plt = pyplot()
    fig, ax = plt.subplots(2, 3, figsize=(16, 8))
    w = report["windows"]
    x = [(v["start_s"] + report["config"]["window_s"] / 2) / 60 for v in w]
    for key in ("p50_s", "p99_s"):
        ax[0, 0].plot(x, [v[key] for v in w], marker="o", label=key)
    for r in report.get("retrains", []):
        ax[0, 0].axvline(r["t"] / 60, color="grey", ls=":", lw=1)
    ax[0, 0].set(title="latency per window (dotted: admin retrain)", xlabel="minute", ylabel="s")
    s = report["samples"]
    t = [v["t"] / 60 for v in s]
    for name in sorted({n for v in s for n in v["rss_mb"]}):
        ax[0, 1].plot(t, [v["rss_mb"].get(name) for v in s], label=name)
    ax[0, 1].set(title="RSS per process", xlabel="minute", ylabel="MiB")
    ax[1, 0].plot(t, [v["redis_used_mb"] for v in s], label="used_memory")
    ax[1, 0].set(title="Redis memory", xlabel="minute", ylabel="MiB")
    ax[1, 1].plot(t, [v["data_dir_mb"] for v in s], label="data dir")
    ax[1, 1].set(title="var/ size", xlabel="minute", ylabel="MiB")
    for name in sorted({n for v in s for n in v["cpu_pct"]}):
        ax[0, 2].plot(t, [v["cpu_pct"].get(name) for v in s], label=name)
    ax[0, 2].set(title="CPU per process (100 = one core)", xlabel="minute", ylabel="%")
    ax[1, 2].plot(t, [v["log_rows"]["requests"] for v in s], label="request rows")
    ax[1, 2].plot(t, [v["log_rows"]["prompts"] for v in s], label="rows with a prompt")
    ax[1, 2].plot(t, [v["stream_keys"] for v in s], label="stream keys")
    ax[1, 2].set(title="log DB rows, Redis streams", xlabel="minute", ylabel="count")
    for a in ax.flat:
        a.legend(fontsize=7)
        a.grid(alpha=0.3)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def write_report(report: dict[str, Any], json_out: Path | None) -> None:
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2, default=str))


def learning_ab(cfg: SoakConfig, workdir: Path, progress: Callable[[str], None] | None = None,
                repeats: int = 1) -> dict[str, Any]:
    """Serving throughput with learning off, then on (learning worker + beat + an admin retrain
    of both models every ``retrain_every_s``: a learner kept busy), same seeded traffic, each on
    a fresh stack that starts from the same trained model versions (``prime_models``);
    ``repeats`` pairs interleaved (off, on, off, on, …) so that a shared machine's changing load
    falls on both sides. ``ratio`` = on / off of the summed answers per second
    between warm-up and the end of sending (the service rate, overloaded or not)."""
    runs: dict[str, Any] = {}
    if not cfg.models_from:  # both sides start from the same trained versions
        cfg = replace(cfg, models_from=str(prime_models(cfg, workdir / "prime")))
    for k in range(repeats):
        for name, learning in (("off", False), ("on", True)):
            c = replace(cfg, learning=learning, retrain_at_s=cfg.retrain_at_s if learning else None,
                        retrain_every_s=cfg.retrain_every_s if learning else None)
            runs[f"{name}{k}"] = run_soak(c, workdir / f"learning-{name}{k}", progress)
    rps = {key: r["summary"]["throughput_rps_after_warmup"] for key, r in runs.items()}
    off = sum(v for key, v in rps.items() if key.startswith("off"))
    on = sum(v for key, v in rps.items() if key.startswith("on"))
    pairs = [rps[f"on{k}"] / rps[f"off{k}"] if rps[f"off{k}"] else None for k in range(repeats)]
    return {"ratio": on / off if off else None, "pair_ratios": pairs, "throughput_rps": rps,
            "cpu_pct_mean": {key: mean_cpu(r["samples"]) for key, r in runs.items()}, "runs": runs}


def compare_executions(cfg: SoakConfig, workdir: Path, modes: list[str],
                       progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The same seeded soak once per execution mode, each on a fresh stack, one after the other:
    whether a mode's median holds flat, and how its first minute compares with the others'."""
    runs = {mode: run_soak(replace(cfg, server_env={**cfg.server_env, "COHORT_EXECUTION": mode}),
                           workdir / f"execution-{mode}", progress) for mode in modes}
    return {"modes": modes, "steadiness": {m: r["steadiness"] for m, r in runs.items()},
            "summary": {m: r["summary"] for m, r in runs.items()}, "runs": runs}


def mean_cpu(samples: list[dict[str, Any]]) -> dict[str, float]:
    """Each process's mean CPU (% of one core) over a run: on a shared host, whether an "on" run
    lost throughput to its learner (the learner's own share) or to other tenants (the serving
    processes got less while the learner stayed idle)."""
    names = sorted({n for s in samples for n in s["cpu_pct"]})
    return {n: round(sum(s["cpu_pct"].get(n, 0.0) for s in samples) / max(len(samples), 1), 1) for n in names}


def soak(
    preset: str = typer.Option(None, help="steady: the continuous-execution soak (15 minutes at 10 req/s, "
                               "answers up to 32 tokens, streamed and n=2 among them, an admin retrain at 90 s); "
                               "it sets those four options."),
    minutes: float = typer.Option(20.0, help="How long traffic is sent."),
    rate: float = typer.Option(4.0, help="Requests per second (Poisson); ~60 % of the stack's capacity."),
    max_tokens: int = typer.Option(32, help="Largest max_tokens a request asks for."),
    warmup_s: float = typer.Option(60.0, help="Left out of the after-warm-up figures."),
    window_s: float = typer.Option(60.0, help="p50/p99 per window of this many seconds."),
    retrain_at_s: float = typer.Option(30.0, help="Admin retrain of both models at this second (<0: none)."),
    retrain_every_s: float = typer.Option(None, help="Retrain again every this many seconds (a busy learner)."),
    learning: bool = typer.Option(True, help="Run the learning worker and beat, as `make serve` does."),
    ab: bool = typer.Option(False, help="Throughput with learning off, then on (busy learner): the ratio."),
    repeats: int = typer.Option(1, help="--ab: interleaved off/on pairs."),
    executions: str = typer.Option(None, help="Execution modes to soak one after the other on fresh stacks, "
                                              "same seeded traffic (e.g. continuous,elastic); --json holds each run."),
    drain_s: float = typer.Option(120.0, help="After sending stops, how long answers may take (then: lost)."),
    server_env: list[str] = typer.Option(None, help="KEY=VALUE for the stack (repeat)."),
    workdir: Path = typer.Option(Path("var/bench/soak"), help="Where the stack keeps its files and logs."),
    models_from: Path = typer.Option(None, help="Start from these model versions (a var/models folder); "
                                                "--ab otherwise trains them first on a stack of their own."),
    json_out: Path = typer.Option(None, "--json"),
    plot: Path = typer.Option(None, help="PNG of the curves (latency, RSS, Redis memory, var/ size)."),
) -> None:
    """Steady mixed OpenAI traffic against `make serve`'s stack: 5xx, lost requests,
    p50/p99 per window, RSS per process, Redis memory, var/ size, retention bounds."""
    def _stop(*_: object) -> None:  # SIGTERM: stop the stack (finally blocks), as Ctrl-C does
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _stop)
    if preset is not None:
        if preset not in PRESETS:
            raise typer.BadParameter(f"--preset: one of {', '.join(PRESETS)}")
        minutes, rate, max_tokens, retrain_at_s = PRESETS[preset]
    cfg = SoakConfig(minutes=minutes, rate=rate, max_tokens=max_tokens, warmup_s=warmup_s, window_s=window_s,
                     retrain_at_s=retrain_at_s if retrain_at_s >= 0 else None, retrain_every_s=retrain_every_s,
                     learning=learning, server_env=parse_env(server_env), drain_s=drain_s,
                     models_from=str(models_from) if models_from else None)
    modes = [m.strip() for m in executions.split(",") if m.strip()] if executions else []
    if ab and modes:
        raise typer.BadParameter("--ab and --executions: one comparison at a time")
    known = get_args(Settings.model_fields["execution"].annotation)  # the settings own the modes
    if any(m not in known for m in modes):
        raise typer.BadParameter(f"--executions: {', '.join(known)}, comma-separated")
    runs = 2 * repeats if ab else max(1, len(modes))
    bar = tqdm(total=int(minutes * 60 / cfg.sample_s) * runs, desc="soak samples", unit="sample")

    def tick(line: str) -> None:
        bar.update(1)
        bar.set_postfix_str(line[:120])

    if ab:
        report = learning_ab(cfg, workdir, tick, repeats)
        typer.echo(f"throughput (req/s) {report['throughput_rps']}: on/off ratio {report['ratio']:.3f}, "
                   f"per pair {report['pair_ratios']}; mean CPU % per process {report['cpu_pct_mean']}")
    elif modes:
        report = compare_executions(cfg, workdir, modes, tick)
        typer.echo(json.dumps({"steadiness": report["steadiness"], "summary": report["summary"]}, indent=1))
        if plot:
            for mode, run in report["runs"].items():
                plot_soak(run, plot.with_name(f"{plot.stem}-{mode}{plot.suffix}"))
    else:
        report = run_soak(cfg, workdir, tick)
        typer.echo(json.dumps({"summary": report["summary"], "trends": report["trends"],
                               "steadiness": report["steadiness"],
                               "latency_first_last": report["latency_first_last"],
                               "windows": report["windows"]}, indent=1))
        if plot:
            plot_soak(report, plot)
    bar.close()
    write_report(report, json_out)
