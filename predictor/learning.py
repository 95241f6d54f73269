"""Continuous learning (Magnus): pick the samples the current model got wrong, add them to the
stored training set, retrain, save a new registry version and activate it.

Selection rules (SPEC "Continuous learning"):
- predictor: |G' − G| > 10 tokens AND > 10 % of G (the actual length);
- estimator: |T̂ − T| > 2 s AND > 20 % of T, where T̂ is re-estimated with the batch's *actual*
  generation length (Magnus re-estimates with actual lengths so that the estimator is judged on
  its own error, not on the predictor's).

Retraining reads the log DB only since the last successful run (a small JSON state file), so the
periodic job is incremental; the stored training sets live under ``<data_dir>/learning/``, bounded
(a recent window plus a reservoir: predictor.train_store), so a retrain costs the same in hour 10
as in minute 10. A file
lock serialises retraining of one target (beat and the admin endpoint may fire together). Nothing
here runs on the request path: the gateway and the batcher pick the new version up through the
registry's ACTIVE file.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from cohort.datasets import data_files, load_split
from cohort.logdb import finished_batches, finished_requests, get_db_engine
from cohort.settings import Settings
from predictor.base import PredictItem
from predictor.data import records_to_items
from predictor.estimator import AnalyticBatchTime, KNNBatchTime, load_estimator
from predictor.metrics import all_metrics
from predictor.registry import Registry
from predictor.train_store import append_bounded, read_rows
from predictor.training import fit_predictor, predict_items, save_model

log = logging.getLogger(__name__)

PRED_ABS_TOKENS = 10
PRED_REL = 0.10
EST_ABS_S = 2.0
EST_REL = 0.20
MIN_ESTIMATOR_SAMPLES = 8
SERVED_ONLY_ROWS = 500  # logged rows of the served model after which the shared warm start is dropped


# --- selection rules (pure) ----------------------------------------------------------------------
def predictor_needs_sample(predicted: float | None, actual: float, abs_tokens: float = PRED_ABS_TOKENS,
                           rel: float = PRED_REL) -> bool:
    """True when the prediction missed by more than ``abs_tokens`` AND more than ``rel``·actual.
    A missing prediction counts as a miss (nothing was known about this request)."""
    if predicted is None:
        return True
    err = abs(float(predicted) - float(actual))
    return err > abs_tokens and err > rel * float(actual)


def estimator_needs_sample(estimated: float | None, actual_s: float, abs_s: float = EST_ABS_S,
                           rel: float = EST_REL) -> bool:
    """True when the batch-time estimate missed by more than ``abs_s`` AND more than ``rel``·actual."""
    if estimated is None:
        return True
    err = abs(float(estimated) - float(actual_s))
    return err > abs_s and err > rel * float(actual_s)


def select_predictor_rows(rows: Sequence[dict[str, Any]], abs_tokens: float = PRED_ABS_TOKENS,
                          rel: float = PRED_REL) -> list[dict[str, Any]]:
    """Log-DB request rows with an actual length whose prediction missed (rule above)."""
    out = []
    for r in rows:
        if r.get("actual_tokens") is None:
            continue
        if predictor_needs_sample(r.get("predicted_tokens"), r["actual_tokens"], abs_tokens, rel):
            out.append(r)
    return out


def select_estimator_rows(rows: Sequence[dict[str, Any]], estimates: Sequence[float | None],
                          abs_s: float = EST_ABS_S, rel: float = EST_REL) -> list[dict[str, Any]]:
    """Batch rows whose (re-)estimate missed the logged batch time (rule above)."""
    return [r for r, e in zip(rows, estimates, strict=True)
            if r.get("batch_time_s") is not None and estimator_needs_sample(e, r["batch_time_s"], abs_s, rel)]


# --- storage -------------------------------------------------------------------------------------
def learning_dir(settings: Settings) -> Path:
    d = Path(settings.data_dir) / "learning"
    d.mkdir(parents=True, exist_ok=True)
    return d


def predictor_store(settings: Settings) -> Path:
    return learning_dir(settings) / "predictor_train.jsonl"


def estimator_store(settings: Settings) -> Path:
    return learning_dir(settings) / "estimator_samples.jsonl"


def profile_samples_path(settings: Settings) -> Path:
    """Where `cohort worker profile` stores its (β, L, G) → seconds samples."""
    return Path(settings.data_dir) / "profile" / "samples.json"


def _store_rows(settings: Settings, path: Path, rows: Sequence[dict[str, Any]]) -> int:
    """Add rows to a training store under the bounds of the settings (predictor.train_store):
    a recent window plus a reservoir, so a retrain's cost does not grow with the run's age."""
    return append_bounded(path, rows, settings.learning.store_recent_rows, settings.learning.store_reservoir_rows)


def _state_path(settings: Settings) -> Path:
    return learning_dir(settings) / "state.json"


def load_state(settings: Settings) -> dict[str, float]:
    try:
        return json.loads(_state_path(settings).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _save_state(settings: Settings, **values: float) -> None:
    state = {**load_state(settings), **values}
    tmp = _state_path(settings).with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, _state_path(settings))


class RetrainRunning(RuntimeError):
    """A retraining of the same target is running: this one is skipped, never queued behind it."""


@contextlib.contextmanager
def _lock(settings: Settings, name: str) -> Iterator[None]:
    """One retraining per target at a time, across processes; a second one does not wait (it
    would only redo the work on the same data): it raises ``RetrainRunning``."""
    with (learning_dir(settings) / f"{name}.lock").open("w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RetrainRunning(f"a retraining of the {name} is running; this one is skipped") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def seed_predictor_store(settings: Settings, limit_per_file: int | None = 500) -> int:
    """First run: start the stored training set from the shared data's train split (if present;
    ``limit_per_file`` rows per Magnus task, 0 = none). Later runs only append. Returns the
    number of rows written."""
    path = predictor_store(settings)
    if path.is_file():
        return 0
    rows: list[dict[str, Any]] = []
    if limit_per_file == 0:  # explicitly: start from the log DB only
        path.touch()
        return 0
    try:
        files = data_files()
        recs = load_split(files, "train", limit_per_file=limit_per_file)
        items, y = records_to_items(recs, settings.model)
        rows = [{"instruction": it.instruction, "user_input": it.user_input, "input_tokens": it.input_tokens,
                 "target": float(t), "task": it.task, "source": "shared-train"}
                for it, t in zip(items, y, strict=True)]
    except FileNotFoundError:
        log.info("no shared data: predictor training set starts from the log DB only")
    path.touch()
    _store_rows(settings, path, rows)
    return len(rows)


# --- retraining ----------------------------------------------------------------------------------
def training_rows(stored: Sequence[dict[str, Any]], served_model: str,
                  served_only_rows: int | None = None) -> list[dict[str, Any]]:
    """What the predictor trains on: the served model's own logged lengths, with the shared data
    (reference answers written by *other* models) only as a warm start.

    Output length depends on the model that writes it, so rows logged for another model are
    dropped, and once ``served_only_rows`` logged rows of the served model exist the shared-data
    rows are dropped too."""
    limit = SERVED_ONLY_ROWS if served_only_rows is None else served_only_rows
    logged = [d for d in stored if str(d.get("source", "")).startswith("log:")
              and d.get("model") in (None, served_model)]
    if len(logged) >= limit:
        return logged
    return [d for d in stored if not str(d.get("source", "")).startswith("log:")] + logged


def _holdout_split(n: int, frac: float = 0.1, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    idx = np.random.default_rng(seed).permutation(n)
    cut = int(round(n * frac)) if n >= 20 else 0
    return idx[cut:], idx[:cut]


def retrain_predictor(settings: Settings, force: bool = False, kind: str | None = None,
                      seed_limit_per_file: int | None = None, **fit_options: Any) -> dict[str, Any]:
    """Add the mispredicted logged requests to the training set, retrain, save and activate.

    Returns ``{"version", "metrics", "n_added", "n_train", "retrained"}``. Without new samples
    (and without ``force``) nothing is retrained and the active version is returned.
    Metrics are measured on a seeded 10 % holdout of the stored set before the final fit on all of it.
    """

    kind = kind or settings.predictor_kind
    if kind == "lora":  # bound the CPU time of a periodic retrain
        fit_options.setdefault("max_examples", 2000)
        fit_options.setdefault("max_steps", 300)
    reg = Registry(settings.data_dir, "predictor")
    with _lock(settings, "predictor"):
        _save_state(settings, predictor_started=time.time())  # what a later-requested retrain coalesces into
        if seed_limit_per_file is None:  # default: COHORT_LEARNING__SEED_ROWS_PER_TASK
            seed_limit_per_file = settings.learning.seed_rows_per_task
        seeded = seed_predictor_store(settings, seed_limit_per_file)
        since = float(load_state(settings).get("predictor_since", 0.0))
        rows = finished_requests(get_db_engine(settings.database_url), since)
        served = [r for r in rows if r.get("model") in (None, settings.model)]
        picked = select_predictor_rows(served)
        new = [{"instruction": r.get("instruction") or "", "user_input": r.get("user_input") or "",
                "input_tokens": int(r.get("input_tokens") or 0), "target": float(r["actual_tokens"]),
                "task": r.get("task"), "model": r.get("model") or settings.model,
                "source": f"log:{r['id']}"} for r in picked]
        _store_rows(settings, predictor_store(settings), new)
        last = max((float(r["finished"]) for r in rows if r.get("finished") is not None), default=since)
        pending = int(load_state(settings).get("predictor_pending", 0)) + len(new)
        if pending < settings.learning.min_new_samples and not seeded and not force and reg.active():
            _save_state(settings, predictor_since=last, predictor_pending=pending)  # stored; fitted once enough
            return {"version": reg.active(), "metrics": reg.meta(reg.active()).get("metrics"),
                    "n_added": len(new), "n_pending": pending, "n_train": None, "retrained": False}
        data = training_rows(read_rows(predictor_store(settings)), settings.model)
        if not data:
            _save_state(settings, predictor_since=last)
            return {"version": reg.active(), "metrics": None, "n_added": 0, "n_train": 0,
                    "retrained": False}
        items = [PredictItem(d["instruction"], d["user_input"], int(d["input_tokens"]), d.get("task"))
                 for d in data]
        y = np.asarray([d["target"] for d in data], dtype=float)
        cache = Path(settings.data_dir) / "cache" / "emb"
        t0 = time.perf_counter()
        tr, ho = _holdout_split(len(items))
        metrics = None
        # One fit per retrain (two fits per round doubled the learner's CPU): the model
        # fitted on the 90 % is the one shipped, measured on the 10 % it never saw. It holds out
        # its own calibration rows (fit_predictor), so its q90 bound is re-calibrated on every
        # retrain, on the lengths the served model produced.
        model = fit_predictor(kind, [items[i] for i in tr], y[tr], cache_dir=cache,
                              encoder_path=settings.encoder_path, **fit_options)
        if len(ho):
            metrics = all_metrics(y[ho], predict_items(model, [items[i] for i in ho], cache))
        version, staging = reg.new_dir()
        n_served = sum(1 for d in data if str(d.get("source", "")).startswith("log:"))
        save_model(model, staging, meta={
            "data": {"rows": len(tr), "holdout": len(ho), "added": len(new), "served_rows": n_served,
                     "served_model": settings.model, "warm_start_used": n_served < SERVED_ONLY_ROWS,
                     "store": str(predictor_store(settings))},
            "metrics": metrics, "train_seconds": round(time.perf_counter() - t0, 2)})
        reg.commit(version, staging)
        _save_state(settings, predictor_since=last, predictor_pending=0)
        log.info("predictor retrained: %s (%d rows, %d new)", version, len(items), len(new))
        return {"version": version, "metrics": metrics, "n_added": len(new), "n_train": len(items),
                "retrained": True}


def _profile_samples(settings: Settings) -> list[dict[str, Any]]:
    p = profile_samples_path(settings)
    if not p.is_file():
        return []
    d = json.loads(p.read_text())
    return d.get("samples", d) if isinstance(d, dict) else d


def cold_start_estimator(settings: Settings) -> AnalyticBatchTime:
    """The analytic model fitted to the worker's profiling samples, else its defaults: what the
    batcher estimates with before continuous learning has a KNN version."""
    try:
        samples = _profile_samples(settings)
    except (OSError, ValueError):
        samples = []
    return AnalyticBatchTime.from_samples(samples) or AnalyticBatchTime()


def current_estimator(settings: Settings):
    """The estimator in force: active registry version, else analytic fitted on profile samples,
    else the analytic defaults."""

    reg = Registry(settings.data_dir, "estimator")
    path = reg.active_path()
    if path is not None:
        try:
            return load_estimator(path)
        except Exception:  # a broken version must not stop learning; fall back
            log.exception("cannot load estimator version %s", path)
    return cold_start_estimator(settings)


def retrain_estimator(settings: Settings, force: bool = False, n_neighbors: int = 5,
                      min_samples: int = MIN_ESTIMATOR_SAMPLES) -> dict[str, Any]:
    """Add the badly estimated logged batches to the sample set (seeded with the profile run),
    refit the KNN estimator, save and activate a new version.

    Ground truth = logged ``batch_time_s`` at (size, input_len, actual_gen_len). Returns
    ``{"version", "metrics", "n_added", "n_train", "retrained"}``; with fewer than ``min_samples``
    samples no KNN is trained (the analytic cold-start model stays in force).
    """

    reg = Registry(settings.data_dir, "estimator")
    with _lock(settings, "estimator"):
        _save_state(settings, estimator_started=time.time())
        store = estimator_store(settings)
        seeded = 0
        if not store.is_file():
            prof = [{"size": int(s["size"]), "input_len": int(s["input_len"]), "gen_len": int(s["gen_len"]),
                     "seconds": float(s["seconds"]), "source": "profile"} for s in _profile_samples(settings)]
            store.touch()
            _store_rows(settings, store, prof)
            seeded = len(prof)
        since = float(load_state(settings).get("estimator_since", 0.0))
        rows = [r for r in finished_batches(get_db_engine(settings.database_url), since)
                if r.get("batch_time_s") is not None and r.get("size") and r.get("actual_gen_len") is not None]
        est = current_estimator(settings)
        shapes = [(int(r["size"]), int(r["input_len"] or 0), int(r["actual_gen_len"])) for r in rows]
        estimates = list(est.estimate_many(shapes)) if shapes else []
        picked = select_estimator_rows(rows, estimates)
        new = [{"size": int(r["size"]), "input_len": int(r["input_len"] or 0),
                "gen_len": int(r["actual_gen_len"]), "seconds": float(r["batch_time_s"]),
                "source": f"log:{r['id']}"} for r in picked]
        _store_rows(settings, store, new)
        last = max((float(r["finished"]) for r in rows if r.get("finished") is not None), default=since)
        _save_state(settings, estimator_since=last)
        data = read_rows(store)
        if (not new and not seeded and not force and reg.active()) or len(data) < min_samples:
            active = reg.active()
            return {"version": active, "metrics": reg.meta(active).get("metrics") if active else None,
                    "n_added": len(new), "n_train": len(data), "retrained": False}
        x = [(d["size"], d["input_len"], d["gen_len"]) for d in data]
        y = np.asarray([d["seconds"] for d in data], dtype=float)
        tr, ho = _holdout_split(len(x))
        metrics = None
        if len(ho):
            m = KNNBatchTime(n_neighbors).fit([x[i] for i in tr], y[tr])
            pred = m.estimate_many([x[i] for i in ho])
            metrics = {"n": int(len(ho)), "mae_s": float(np.mean(np.abs(pred - y[ho]))),
                       "mape": float(np.mean(np.abs(pred - y[ho]) / np.maximum(y[ho], 1e-6)))}
        # KNN's fit is storing the points: refitting on the bounded store is the incremental fit
        # (cost bounded by the store's size, not the run's age).
        model = KNNBatchTime(n_neighbors).fit(x, y)
        version, staging = reg.new_dir()
        model.save(staging, meta={"data": {"rows": len(x), "added": len(new)}, "metrics": metrics})
        reg.commit(version, staging)
        log.info("estimator retrained: %s (%d samples, %d new)", version, len(x), len(new))
        return {"version": version, "metrics": metrics, "n_added": len(new), "n_train": len(x),
                "retrained": True}
