"""`cohort predictor ...` commands: train, eval, replay, register, versions, activate, embed, coverage.

``train`` fits on the 80 % split of each ``--data`` file, ``eval`` reports on the 20 % split (the
split is seeded per file by ``cohort.datasets``), so evaluation never sees a training row.
Magnus features go through the on-disk embedding cache (``<data_dir>/cache/emb``) so that
repeated runs do not re-encode the same texts; ``predictions_per_s`` in the eval JSON is measured
without the cache (encoder included), as the gateway would see it.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import typer

from cohort.datasets import load_split
from cohort.settings import get_settings
from predictor.base import PredictItem
from predictor.buckets import parse_edges
from predictor.conformal import coverage, predict_bounds
from predictor.cost_cli import recompute_search
from predictor.data import magnus_feature_matrix, records_to_items
from predictor.live_coverage import coverage_command
from predictor.loading import KINDS, load_predictor
from predictor.metrics import all_metrics
from predictor.registry import Registry, UnknownVersion, new_version_name
from predictor.service import PredictorService
from predictor.training import fit_predictor, predict_items, save_model

app = typer.Typer(help="Length predictors: train, evaluate, register and roll back versions.", no_args_is_help=True)



def _settings():

    return get_settings()


def _cache_dir(use_cache: bool) -> Path | None:
    """The on-disk embedding cache holds torch-encoder vectors (it is keyed by encoder path only), so
    with another ``encoder_backend`` it is bypassed: an eval of that backend must see its own vectors."""
    s = _settings()
    return Path(s.data_dir) / "cache" / "emb" if use_cache and s.encoder_backend == "torch" else None


@app.command()
def train(
    kind: str = typer.Option(..., help="magnus | magnus_fast | semantic | lora | linear | mean"),
    data: list[Path] = typer.Option(..., help="JSONL data files (shared-data format); repeat the option."),
    out: Path = typer.Option(..., help="Model directory to write."),
    limit_per_file: int | None = typer.Option(None, help="Use at most N training rows per file (seeded)."),
    n_estimators: int = typer.Option(100, help="magnus: trees."),
    min_samples_leaf: int = typer.Option(2, help="magnus: min samples per leaf."),
    max_depth: int | None = typer.Option(None, help="magnus: max tree depth."),
    max_features: float | None = typer.Option(None, help="magnus: share of features per split (default all)."),
    max_iter: int = typer.Option(300, help="semantic: boosting iterations."),
    learning_rate: float = typer.Option(0.08, help="semantic: boosting learning rate."),
    max_leaf_nodes: int = typer.Option(63, help="semantic: leaves per tree."),
    base_model: str | None = typer.Option(None, help="lora: HF base model path (default: bundled MiniLM)."),
    max_examples: int | None = typer.Option(4000, help="lora: train on at most N examples."),
    max_steps: int | None = typer.Option(None, help="lora: at most N optimizer steps."),
    epochs: float = typer.Option(1.0, help="lora: epochs over the (capped) examples."),
    batch_size: int = typer.Option(16, help="lora: batch size."),
    lr: float = typer.Option(1e-3, help="lora: learning rate."),
    max_length: int = typer.Option(128, help="lora: max input tokens of the classifier."),
    edges: str | None = typer.Option(None, help="lora: bucket edges, e.g. 0,8,16,...,2048."),
    representative: str = typer.Option("upper", help="lora: upper | lower | mid | mean."),
    length_hint: bool = typer.Option(True, help="lora: prefix the input length to the text."),
    cache: bool = typer.Option(True, help="magnus: use the on-disk embedding cache."),
    calibration_frac: float = typer.Option(0.15, help="Share of the training rows held out of the fit "
                                           "to calibrate the upper quantile (0: no upper bound)."),
    level: float = typer.Option(0.9, help="Coverage level of the upper bound (q90 = 0.9)."),
) -> None:
    """Train a predictor on the 80 % split of each file and write a model directory with meta.json."""

    if kind not in KINDS:
        raise typer.BadParameter(f"--kind must be one of {KINDS}")
    s = _settings()
    t0 = time.perf_counter()
    recs = load_split(data, "train", limit_per_file=limit_per_file)
    items, y = records_to_items(recs, s.model)
    typer.echo(f"training {kind} on {len(items)} rows from {len(data)} file(s)", err=True)
    opts: dict = {}
    if kind in ("magnus", "magnus_fast"):
        opts = {"n_estimators": n_estimators, "min_samples_leaf": min_samples_leaf, "max_depth": max_depth,
                "max_features": max_features}
    elif kind == "semantic":
        opts = {"max_iter": max_iter, "learning_rate": learning_rate, "max_leaf_nodes": max_leaf_nodes}
    elif kind == "lora":
        opts = {"base_model": base_model, "max_examples": max_examples, "max_steps": max_steps,
                "epochs": epochs, "batch_size": batch_size, "lr": lr, "max_length": max_length,
                "edges": parse_edges(edges), "representative": representative, "length_hint": length_hint}
    model = fit_predictor(kind, items, y, cache_dir=_cache_dir(cache), encoder_path=s.encoder_path,
                          show_progress=True, calibration_frac=calibration_frac, level=level, **opts)
    seconds = time.perf_counter() - t0
    by_task: dict[str, int] = defaultdict(int)
    for r in recs:
        by_task[r.task] += 1
    meta = {"version": new_version_name(), "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "data": {"files": [str(p) for p in data], "split": "train", "rows": len(items),
                     "limit_per_file": limit_per_file, "per_task": dict(by_task), "tokenizer": s.model},
            "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.items()},
            "train_seconds": round(seconds, 1)}
    save_model(model, out, meta=meta)
    typer.echo(json.dumps({"out": str(out), "kind": kind, "rows": len(items), "train_seconds": round(seconds, 1)}))


def _throughput(model, items, n: int = 512, batch: int = 64) -> dict[str, float]:
    """Predictions/s micro-batched (batches of ``batch``) and p50 latency at batch 1, end to end
    (encoder included, no embedding cache). Every request in the first two measurements is one the
    model has not seen (its in-memory vector caches would otherwise answer); the third repeats the
    micro-batched requests, as an application repeating its instruction and inputs would."""
    if not items:
        return {"predictions_per_s": 0.0}
    rng = np.random.default_rng(0)
    pick = rng.choice(len(items), min(n + 64, len(items)), replace=False)
    sample = [items[i] for i in pick[:n]]
    single = [items[i] for i in pick[n:]] or sample[:64]
    if hasattr(model, "clear_vector_caches"):  # the metric pass may have filled them with these items
        model.clear_vector_caches()
    model.predict([PredictItem("warm up", "warm up", 2)])  # lazy encoder load
    t0 = time.perf_counter()
    for i in range(0, len(sample), batch):
        model.predict(sample[i:i + batch])
    per_s = len(sample) / (time.perf_counter() - t0)
    lat = []
    for it in single:
        t1 = time.perf_counter()
        model.predict([it])
        lat.append(time.perf_counter() - t1)
    t0 = time.perf_counter()
    for i in range(0, len(sample), batch):
        model.predict(sample[i:i + batch])
    repeated = len(sample) / (time.perf_counter() - t0)
    return {"predictions_per_s": float(per_s), "batch": batch,
            "latency_ms_batch1_p50": float(np.median(lat) * 1000),
            "predictions_per_s_batch1": float(1.0 / np.mean(lat)),
            "predictions_per_s_repeated": float(repeated)}


@app.command("eval")
def evaluate(
    model: Path = typer.Option(..., help="Model directory."),
    data: list[Path] = typer.Option(..., help="JSONL data files; evaluated on their 20 % split."),
    json_out: Path = typer.Option(..., "--json", help="Where to write the metrics JSON."),
    plot: Path | None = typer.Option(None, help="Directory for predicted-vs-actual and error-CDF PNGs."),
    limit_per_file: int | None = typer.Option(None, help="Evaluate at most N validation rows per file."),
    cache: bool = typer.Option(True, help="magnus: use the embedding cache for the metric pass."),
    throughput_n: int = typer.Option(512, help="Items for the throughput measurement (0: skip)."),
    representative: str | None = typer.Option(None, help="lora: override the bucket representative "
                                              "(upper | lower | mid | mean)."),
) -> None:
    """Evaluate a model on the validation split: overall and per-task metrics, throughput."""

    s = _settings()
    m = load_predictor(model)
    if representative is not None:
        if m.kind != "lora":
            raise typer.BadParameter("--representative applies to lora models only")
        m.set_representative(representative)
    recs = load_split(data, "val", limit_per_file=limit_per_file)
    items, y = records_to_items(recs, s.model)
    typer.echo(f"evaluating {m.kind} on {len(items)} validation rows", err=True)
    pred = predict_items(m, items, _cache_dir(cache))
    _, upper = predict_bounds(m, items, pred)
    tasks = np.array([r.task for r in recs])

    def metrics(sel: np.ndarray) -> dict:
        # q90_coverage: share of actual lengths ≤ the upper bound (None: the model has no bound).
        return {**all_metrics(y[sel], pred[sel]),
                "q90_coverage": None if upper is None else coverage(y[sel], upper[sel])}

    per_task = {t: metrics(tasks == t) for t in dict.fromkeys(tasks.tolist())}
    result = {"model": str(model), "kind": m.kind, "encoder_backend": s.encoder_backend,
              "representative": getattr(m, "representative", None),
              "level": None if m.conformal is None else m.conformal.level,
              "overall": metrics(np.ones(len(y), dtype=bool)), "per_task": per_task}
    if throughput_n > 0:
        result.update(_throughput(m, items, throughput_n))
    else:
        result["predictions_per_s"] = None
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(result, indent=2))
    if plot is not None:
        _plots(y, pred, tasks, plot, f"{m.kind} ({model.name})")
    typer.echo(json.dumps({"overall": result["overall"], "predictions_per_s": result.get("predictions_per_s"),
                           "q90_coverage_per_task": {t: v["q90_coverage"] for t, v in per_task.items()}}))


def _plots(actual: np.ndarray, pred: np.ndarray, tasks: np.ndarray, out: Path, title: str) -> None:
    import matplotlib  # optional and slow to import: only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 6))
    for t in dict.fromkeys(tasks.tolist()):
        sel = tasks == t
        ax.scatter(actual[sel] + 1, pred[sel] + 1, s=4, alpha=0.4, label=t)
    hi = max(float(actual.max(initial=1)), float(pred.max(initial=1))) + 1
    ax.plot([1, hi], [1, hi], "k--", lw=1)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("actual tokens + 1")
    ax.set_ylabel("predicted tokens + 1")
    ax.set_title(f"predicted vs actual: {title}")
    ax.legend(markerscale=3, fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "pred_vs_actual.png", dpi=120)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(6, 4))
    err = np.sort(np.abs(pred - actual))
    ax.plot(err, np.arange(1, len(err) + 1) / max(len(err), 1))
    ax.set_xscale("symlog")
    ax.set_xlabel("|predicted − actual| tokens")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"error CDF: {title}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "error_cdf.png", dpi=120)
    plt.close(fig)


@app.command()
def register(
    model: Path = typer.Option(..., help="Model directory to copy into the registry."),
    target: str = typer.Option("predictor", help="predictor | estimator"),
    activate: bool = typer.Option(True, help="Make it the active version."),
) -> None:
    """Copy a trained model directory into the registry as a new version (and activate it)."""

    reg = Registry(_settings().data_dir, target)
    version = reg.register_dir(model, activate=activate)
    typer.echo(json.dumps({"target": target, "version": version, "active": reg.active()}))


@app.command()
def versions(target: str = typer.Option("predictor", help="predictor | estimator")) -> None:
    """List the registry's versions and the active one."""

    typer.echo(json.dumps(Registry(_settings().data_dir, target).listing(), indent=2))


@app.command("activate")
def activate_version(version: str, target: str = typer.Option("predictor", help="predictor | estimator")) -> None:
    """Activate a version (rollback = activate an older one)."""

    reg = Registry(_settings().data_dir, target)
    try:
        reg.activate(version)
    except UnknownVersion:
        typer.echo(f"unknown {target} version {version!r}", err=True)
        raise typer.Exit(1) from None
    typer.echo(json.dumps({"target": target, "active": version}))


@app.command()
def embed(
    data: list[Path] = typer.Option(..., help="JSONL data files to encode into the cache."),
    part: str = typer.Option("all", help="train | val | all"),
    limit_per_file: int | None = typer.Option(None, help="At most N rows per file."),
) -> None:
    """Pre-compute sentence embeddings into the on-disk cache (long; shows a progress bar)."""

    s = _settings()
    recs = load_split(data, part, limit_per_file=limit_per_file)
    items, _ = records_to_items(recs, s.model)
    x = magnus_feature_matrix(items, _cache_dir(True), s.encoder_path, show_progress=True)
    typer.echo(json.dumps({"rows": int(x.shape[0])}))


@app.command("bench")
def bench_service(
    model: Path = typer.Option(..., help="Model directory (served through PredictorService)."),
    data: list[Path] = typer.Option(..., help="JSONL data files; requests drawn from their 20 % split."),
    n: int = typer.Option(512, help="Requests per measurement."),
    concurrency: int = typer.Option(64, help="Concurrent requests in the micro-batched run."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the result here too."),
) -> None:
    """Gateway-side prediction speed: p50 latency one request at a time, and predictions/s with
    ``concurrency`` requests in flight (PredictorService micro-batching), encoder included."""


    s = _settings().model_copy(update={"predictor_dir": model})
    recs = load_split(data, "val")
    items, _ = records_to_items(recs, s.model)
    rng = np.random.default_rng(1)
    pick = rng.choice(len(items), min(n + 100, len(items)), replace=False)
    sample = [items[i] for i in pick[:n]]
    single = [items[i] for i in pick[n:]] or sample[:100]  # unseen: no vector cache hits
    svc = PredictorService(s)
    svc.warmup()

    async def sequential() -> list[float]:
        lat = []
        for it in single:
            t0 = time.perf_counter()
            await svc.predict(it, 2048)
            lat.append(time.perf_counter() - t0)
        return lat

    async def concurrent() -> float:
        sem = asyncio.Semaphore(concurrency)

        async def one(it):
            async with sem:
                await svc.predict(it, 2048)

        t0 = time.perf_counter()
        await asyncio.gather(*[one(it) for it in sample])
        return time.perf_counter() - t0

    lat = asyncio.run(sequential())
    batches0 = svc.batches_run
    seconds = asyncio.run(concurrent())
    res = {"model": str(model), "kind": svc.model.kind if svc.model else None,
           "encoder_backend": s.encoder_backend, "n": len(sample),
           "batch1_p50_ms": float(np.median(lat) * 1000), "batch1_per_s": float(len(lat) / sum(lat)),
           "concurrency": concurrency, "micro_batched_per_s": float(len(sample) / seconds),
           "mean_batch": float(len(sample) / max(1, svc.batches_run - batches0))}
    svc.close()
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(res, indent=2))
    typer.echo(json.dumps(res))


@app.command("replay")
def replay_command(
    model: Path = typer.Option(..., help="Model directory (served through PredictorService)."),
    data: list[Path] = typer.Option(..., help="JSONL data files, streamed in this order (file order within each)."),
    json_out: Path = typer.Option(..., "--json", help="Where to write the windows / final JSON."),
    plot: Path | None = typer.Option(None, help="PNG of coverage and τ / MAE per window."),
    part: str = typer.Option("all", help="all | train | val: which split of each file is streamed."),
    limit_per_file: int | None = typer.Option(None, help="At most N rows per file (seeded, order kept)."),
    chunk: int = typer.Option(50, help="Rows predicted, then completed and learnt from, at a time."),
    window: int = typer.Option(250, help="Rows per reported window."),
    final: int = typer.Option(500, help="The final metrics are over the last N rows."),
    task_labels: bool = typer.Option(False, help="Give the predictor each row's task (source) name; off: "
                                     "unlabelled traffic, as a gateway that is not told the task sees it."),
    online: bool = typer.Option(True, help="Online conformal recalibration (off: the static table only)."),
    gamma: float | None = typer.Option(None, help="ACI step size (default COHORT_ONLINE__GAMMA)."),
    online_window: int | None = typer.Option(None, help="Online window (default COHORT_ONLINE__WINDOW)."),
    shuffle: int | None = typer.Option(None, help="Interleave the files' rows in a random order with this seed "
                                       "(mixed traffic) instead of one file after the other."),
) -> None:
    """Stream rows in order through predict → complete → learn (the live code path) and report
    τ, MAE and q90 coverage per window of rows and over the last rows. Starts from a fresh online
    state (a temporary data dir), so runs do not leak into each other or into the live state."""
    import tempfile

    from predictor.replay import plot_replay, replay

    if part not in ("all", "train", "val"):
        raise typer.BadParameter("--part must be all, train or val")
    base = _settings()
    recs = load_split(data, part, limit_per_file=limit_per_file)
    if shuffle is not None:
        import random

        random.Random(shuffle).shuffle(recs)
    items, y = records_to_items(recs, base.model)
    if not task_labels:
        items = [PredictItem(it.instruction, it.user_input, it.input_tokens) for it in items]
    with tempfile.TemporaryDirectory(prefix="cohort-replay-") as tmp:
        knobs: dict = {"conformal": online}
        if gamma is not None:
            knobs["gamma"] = gamma
        if online_window is not None:
            knobs["window"] = online_window
        svc = PredictorService(base.model_copy(update={
            "predictor_dir": model, "data_dir": Path(tmp), "database_url": f"sqlite:///{tmp}/replay.db",
            "online": base.online.model_copy(update=knobs)}))
        svc.maybe_reload(force=True)
        typer.echo(f"replaying {len(items)} rows through {svc.model.kind if svc.model else None}", err=True)
        res = replay(svc, items, y, sources=np.array([r.task for r in recs]), chunk=chunk, window=window,
                     final=final, progress=True)
        svc.close()
    res = {"model": str(model), "data": [str(p) for p in data], "part": part, "task_labels": task_labels,
           "shuffle": shuffle, "clusters": base.online.clusters, **res}
    json_out.parent.mkdir(parents=True, exist_ok=True)
    json_out.write_text(json.dumps(res, indent=2))
    if plot is not None:
        plot_replay(res, plot, f"replay: {model.name} on {', '.join(p.name for p in data)}")
    typer.echo(json.dumps({"final": res["final"], "windows": len(res["windows"])}))


app.command("recompute-search")(recompute_search)
app.command("coverage")(coverage_command)  # live q90 coverage from the log DB

if __name__ == "__main__":  # `python -m predictor.cli` = `cohort predictor`
    app()
