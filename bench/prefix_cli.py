"""`cohort bench prefix`: the chat-prefix workload with and without prefix caching, simulated or
live, in one run (``bench.prefix_bench``); JSON and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from batcher.policies.spf import DEFAULT_PREFIX_WINDOW
from bench.chat_prefix import ChatPrefixConfig
from bench.continuous_run import DEFAULT_GROUP_FRAC
from bench.live_stack import parse_env
from bench.prefix_bench import prefix_live, prefix_live_routing, prefix_sim, ratios
from bench.report import pyplot

PLOT_KEYS = {"sim": ("request_throughput", "mean_ttft_s", "mean_latency_s", "prefix_hit_rate"),
             "live": ("throughput_rps", "mean_ttft_s", "mean_latency_s", "prefix_hit_rate")}


def _plot(runs: dict[str, dict[str, Any]], keys: tuple[str, ...], path: Path) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.2))
    names = list(runs)
    for ax, key in zip(axes, keys, strict=True):
        ax.bar(range(len(names)), [float(runs[n].get(key) or 0.0) for n in names], color=[f"C{i}" for i in range(len(names))])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=7)
        ax.set_title(key)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def prefix(
    live: bool = typer.Option(False, help="Spawn stacks of the built-in engine (cache on and off) and replay over "
                              "HTTP; default: the simulator."),
    requests: int = typer.Option(3000, help="Chat turns in the trace."),
    rate: float = typer.Option(80.0, help="Simulator: offered requests/s (live: the rate is a share of capacity)."),
    seed: int = typer.Option(0),
    max_tokens: int = typer.Option(512, help="Answers are capped here (reference lengths, emulated live)."),
    systems: int = typer.Option(32, help="Distinct system prompts (200-1,000 tokens, Zipf-popular)."),
    policy: str = typer.Option("spf", help="cohort's policy."),
    instances: int = typer.Option(4, help="Simulator: instances (--live-routing: built-in workers)."),
    live_routing: bool = typer.Option(False, help="Live: the pool queue against prefix-aware routing on --instances "
                                      "built-in workers with their caches, the trace at --rate req/s."),
    kv_tokens: int = typer.Option(12_000, help="Simulator: KV tokens per instance (0: the preset's Θ)."),
    affinity: int = typer.Option(32, help="Simulator: groups an instance looks through for its cached prefix."),
    at_capacity: float = typer.Option(0.0, help="Simulator: measure least-loaded routing's capacity at --rate, then "
                                      "offer every setting this share of it (1: the baseline saturated; 0: --rate)."),
    group_frac: float = typer.Option(DEFAULT_GROUP_FRAC, help="Simulator: the share of Θ an admission group is "
                                     "planned with (the built-in engine's default; an upstream pool plans with 0.2)."),
    prefix_window: float = typer.Option(DEFAULT_PREFIX_WINDOW, help="Simulator: spf's COHORT_SPF_PREFIX_WINDOW "
                                        "(0: a group takes only prefix mates of equal rank)."),
    load: float = typer.Option(0.8, help="Live: offered load as a share of the cache-off capacity."),
    engine: str = typer.Option(None, help="Live: an OpenAI-compatible engine's base URL ending in /v1 (vLLM with "
                               "--enable-prefix-caching), replayed direct at --engine-load of its capacity."),
    engine_load: float = typer.Option(0.5, help="Live: the engine's, and cohort's, share of own capacity."),
    server_env: list[str] = typer.Option(None, help="KEY=VALUE for the spawned stacks (repeat)."),
    workdir: Path = typer.Option(Path("var/bench/prefix")),
    json_out: Path = typer.Option(None, "--json"), plot: Path = typer.Option(None),
) -> None:
    """Prefix caching on the chat-prefix workload: off, on with least-loaded routing, on with
    prefix-aware routing (simulator), or off and on live; ratios to the cache-off run."""
    cfg = ChatPrefixConfig(requests=requests, rate=rate, seed=seed, max_tokens=max_tokens, n_system_prompts=systems)
    if live_routing:
        out = prefix_live_routing(cfg, policy=policy, rate=rate, workers=instances, env=parse_env(server_env),
                                  workdir=workdir)
        base = "pool queue"
        keys = PLOT_KEYS["live"]
    elif live:
        out = prefix_live(cfg, policy=policy, load=load, env=parse_env(server_env), workdir=workdir, engine=engine,
                          engine_load=engine_load)
        base = f"no cache @ {load:g}x no-cache capacity"
        keys = PLOT_KEYS["live"]
        typer.echo(f"capacity (req/s): {json.dumps(out['config']['capacity_rps'])}")
    else:
        out = prefix_sim(cfg, policy=policy, instances=instances, kv_tokens=kv_tokens or None, affinity=affinity,
                         at_capacity=at_capacity or None, progress=typer.echo, group_frac=group_frac,
                         params={"spf_prefix_window": prefix_window})
        base = f"{policy} no cache"
        keys = PLOT_KEYS["sim"]
    out["ratios_to"] = base
    out["ratios"] = ratios(out["runs"], base, [*keys, "p99_latency_s"])
    typer.echo(f"trace: {out['config']['trace']['page_hit_fraction']:.3f} of prompt tokens in pages seen before")
    for name, m in out["runs"].items():
        r = out["ratios"][name]
        typer.echo(f"{name:>42}: " + ", ".join(f"{k} {m.get(k, 0.0):.3f} (x{r.get(k) or 0:.2f})" for k in keys))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(out, indent=2, default=float))
    if plot:
        _plot(out["runs"], keys, plot)
