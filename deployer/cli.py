"""``cohort deploy``: plan where a model's layers go on a (heterogeneous) GPU cluster.

Mounted by the main CLI as ``cohort deploy``; stand-alone:
``python -c "from deployer.cli import app; app()" plan --topology ... --model ...``.
"""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from deployer.cluster import GB
from deployer.helr_cost import DeploymentInfeasible, fmt_bytes
from deployer.topology import load_cluster

if TYPE_CHECKING:
    from deployer.planner import Deployment

app = typer.Typer(
    help="HELR deployer: topology-aware placement of model layers on heterogeneous GPUs.",
    no_args_is_help=True,
)


class Mode(str, Enum):
    he = "he"
    lr = "lr"
    helr = "helr"


@app.callback()
def _main() -> None:
    """HELR deployer: topology-aware placement of model layers on heterogeneous GPUs."""


def render_table(dep: Deployment) -> str:
    """Readable report of a :class:`~deployer.planner.Deployment` (plan + baselines)."""
    shape, prob, plan = dep.shape, dep.problem, dep.plan
    by_id = {d.id: d for d in dep.cluster.devices}
    lines = [
        f"HELR plan, mode={dep.mode}: {shape.num_layers} layers x {fmt_bytes(shape.bytes_per_layer)}, "
        f"embeddings {fmt_bytes(shape.first_bytes)}, head {fmt_bytes(shape.last_bytes)}, "
        f"total {fmt_bytes(shape.total_bytes)}; KV reserve T = {fmt_bytes(prob.kv_reserve)} per device",
        "",
        f"{'stage':>5}  {'device':>6}  {'name':<24} {'perf':>5}  {'layers':>6}  {'range':>9}  "
        f"{'used':>10}  {'free':>10}  {'cost ms':>8}",
    ]
    start = 0
    for k, (pos, n_layers) in enumerate(zip(plan.order, plan.layers, strict=True)):
        dev = by_id[prob.ids[pos]]
        used = plan.used_bytes[k]
        free = int(prob.mem[pos]) - used
        read = prob.layer_bytes * n_layers
        read += prob.first_read_bytes if k == 0 else 0
        read += prob.last_read_bytes if k == len(plan.order) - 1 else 0
        cost = prob.p * read / prob.perf[pos]  # this stage's compute, head included
        rng = f"{start}-{start + n_layers - 1}" if n_layers else "-"
        start += n_layers
        lines.append(f"{k:>5}  {dev.id:>6}  {dev.name[:24]:<24} {dev.perf:>5.2f}  {n_layers:>6}  {rng:>9}  "
                     f"{fmt_bytes(used):>10}  {fmt_bytes(free):>10}  {cost:>8.3f}")
    unused = [d.id for d in dep.cluster.devices if d.id not in dep.devices]
    lines += [
        "",
        "(used = weights placed; free = device memory - used, of which T is kept for the KV cache;",
        " cost ms = that stage's weight reads / perf)",
        f"pipeline order {dep.devices}" + (f" (unused: {unused})" if unused else ""),
        f"predicted cost {dep.predicted_cost:.3f} ms/token = compute {dep.evaluation.compute_ms:.3f} + "
        f"hops {dep.evaluation.hop_ms:.3f}",
        "",
        f"{'baseline':<9}  {'devices':<14} {'layers':<24} {'cost ms':>8}  {'vs plan':>8}  fits",
    ]
    for name, (_dmap, ev) in dep.baselines.items():
        if ev is None:
            lines.append(f"{name:<9}  (unavailable)")
            continue
        layers = ",".join(f"{d}:{k}" for d, k in ev.layers.items())
        ratio = ev.cost / dep.predicted_cost if dep.predicted_cost else float("nan")
        fits = "yes" if ev.fits else f"NO (over budget on {ev.over_budget})"
        lines.append(f"{name:<9}  {str(ev.order):<14} {layers:<24} {ev.cost:>8.3f}  {ratio:>7.2f}x  {fits}")
    return "\n".join(lines)


@app.command()
def plan(
    topology: Path | None = typer.Option(None, "--topology", exists=True, dir_okay=False,
                                         help="`nvidia-smi topo -m` text or a YAML cluster file "
                                              "(auto-detected). Omit to probe the local GPUs."),
    model: Path = typer.Option(..., "--model", exists=True,
                               help="HF model directory or a bare config.json (read on the meta device)."),
    gpus: Path | None = typer.Option(None, "--gpus", exists=True, dir_okay=False,
                                     help="`nvidia-smi --query-gpu=index,name,memory.total,memory.used"
                                          "[,power.limit] --format=csv` output (free memory, power caps)."),
    mode: Mode = typer.Option(Mode.helr, "--mode", help="he: fewest GPUs; lr: lowest latency; helr: weighted."),
    a1: float = typer.Option(1.0, "--a1", help="helr weight on predicted cost (ms/token)."),
    a2: float = typer.Option(1.0, "--a2", help="helr weight on the number of GPUs used."),
    kv_reserve_gb: float = typer.Option(2.0, "--kv-reserve-gb", help="KV-cache reserve T kept free per GPU (GiB)."),
    dtype: str | None = typer.Option(None, "--dtype", help="Weight dtype (default: the config's, else float16)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the plan as JSON here."),
) -> None:
    """Plan a device_map for MODEL on the cluster and compare it with the even and balanced maps."""
    # torch and transformers (seconds): loaded by the one command that reads a model
    from deployer.model_shape import load_model_shape
    from deployer.planner import plan_deployment

    try:
        cluster = load_cluster(topology, gpus)
    except (ValueError, RuntimeError) as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    shape = load_model_shape(model, dtype=dtype)
    try:
        dep = plan_deployment(shape, cluster, mode=mode.value, a1=a1, a2=a2,
                              kv_reserve_bytes=int(kv_reserve_gb * GB))
    except DeploymentInfeasible as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc
    typer.echo(render_table(dep))
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(dep.to_json(), indent=2))
        typer.echo(f"\nwrote {json_out}")


if __name__ == "__main__":  # pragma: no cover
    app()
