"""Build and fit any predictor kind from items and targets (used by the CLI and by retraining).

Why here and not in each class: the CLI, continuous learning and the tests all need "train a
<kind> on these rows", and Magnus features should go through the on-disk embedding cache
whenever there is one, so a retrain does not re-encode texts it has already seen.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from predictor.base import LengthPredictor, PredictItem
from predictor.conformal import DEFAULT_LEVEL, ConformalTable, calibration_split
from predictor.data import magnus_feature_matrix
from predictor.loading import KINDS, predictor_class

CALIBRATION_FRAC = 0.15


def fit_predictor(kind: str, items: Sequence[PredictItem], targets: Sequence[float],
                  cache_dir: str | Path | None = None, encoder_path: str | None = None,
                  show_progress: bool = False, calibration_frac: float = CALIBRATION_FRAC,
                  level: float = DEFAULT_LEVEL, **options: Any) -> LengthPredictor:
    """A trained predictor of ``kind`` with its conformal table (``model.conformal``).

    ``calibration_frac`` of each task's rows (seeded; see ``calibration_split``) are held out of the
    fit and used only to calibrate the upper ``level`` quantile, so the bound is calibrated on rows
    the model never saw; with too few
    rows to spare (or ``calibration_frac`` 0) the model trains on all rows and has no table.
    ``options`` go to the model (e.g. n_estimators for magnus; base_model, max_examples, max_steps,
    epochs, edges, representative for lora)."""
    y = np.asarray(targets, dtype=float)
    fit_idx, cal_idx = calibration_split(items, calibration_frac)
    if not len(cal_idx):
        model = _fit_kind(kind, items, y, cache_dir, encoder_path, show_progress, **options)
        model.conformal = None
        return model
    model = _fit_kind(kind, [items[i] for i in fit_idx], y[fit_idx], cache_dir, encoder_path,
                      show_progress, **options)
    cal_items = [items[i] for i in cal_idx]
    model.conformal = ConformalTable.fit(cal_items, y[cal_idx], predict_items(model, cal_items, cache_dir),
                                         level=level)
    return model


def save_model(model: LengthPredictor, directory: str | Path, meta: dict[str, Any] | None = None) -> None:
    """Write the model directory: the model's own files and meta.json, plus its conformal table
    (``conformal.json``) so the bound is versioned with the model it calibrates."""
    table: ConformalTable | None = getattr(model, "conformal", None)
    info = dict(meta or {})
    if table is not None:
        info["conformal"] = {"level": table.level, "groups": table.counts}
    model.save(Path(directory), meta=info)
    if table is not None:
        table.save(directory)


_RF_KEYS = ("n_estimators", "max_depth", "min_samples_leaf", "seed")
_SEMANTIC_KEYS = ("max_iter", "learning_rate", "max_leaf_nodes", "min_samples_leaf", "l2_regularization",
                  "ridge_alpha", "seed")
_LORA_INIT = ("base_model", "edges", "representative", "max_length", "lora_r", "lora_alpha", "lora_dropout",
              "target_modules", "length_hint", "threads")
_LORA_FIT = ("epochs", "batch_size", "lr", "max_examples", "max_steps", "seed")


def _pick(options: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    return {k: options[k] for k in keys if options.get(k) is not None}


def _fit_mean(cls, items, y, ctx, options):
    return cls().fit(items, y)


def _fit_forest(cls, items, y, ctx, options):
    """magnus and magnus_fast: a random forest over the (cached) Magnus features."""
    model = cls(encoder_path=ctx["encoder_path"], **_pick(options, _RF_KEYS))
    if options.get("max_features") is not None:  # share of features tried per split
        model.model.set_params(max_features=options["max_features"])
    if getattr(cls, "kind", "") == "magnus":  # the paper's features go through the embedding cache
        x = magnus_feature_matrix(items, ctx["cache_dir"], ctx["encoder_path"], show_progress=ctx["show_progress"],
                                  dtype=model.encoder_dtype)
        return model.fit(items, y, features=x)
    return model.fit(items, y)


def _fit_semantic(cls, items, y, ctx, options):
    return cls(encoder_path=ctx["encoder_path"], **_pick(options, _SEMANTIC_KEYS)).fit(items, y)


def _fit_lora(cls, items, y, ctx, options):
    return cls(**_pick(options, _LORA_INIT)).fit(items, y, show_progress=ctx["show_progress"],
                                                 **_pick(options, _LORA_FIT))


# kind -> how to build and fit it; the kinds themselves are predictor.loading's registry.
_FIT = {"mean": _fit_mean, "linear": _fit_mean, "magnus": _fit_forest, "magnus_fast": _fit_forest,
        "semantic": _fit_semantic, "lora": _fit_lora}
assert set(_FIT) == set(KINDS), "every predictor kind needs a fit rule"


def _fit_kind(kind: str, items: Sequence[PredictItem], y: np.ndarray, cache_dir: str | Path | None,
              encoder_path: str | None, show_progress: bool, **options: Any) -> LengthPredictor:
    """Fit one predictor of ``kind`` on all of ``items`` (no calibration)."""
    cls = predictor_class(kind)
    ctx = {"cache_dir": cache_dir, "encoder_path": encoder_path, "show_progress": show_progress}
    return _FIT[kind](cls, items, y, ctx, options)


def predict_items(model: LengthPredictor, items: Sequence[PredictItem], cache_dir: str | Path | None = None,
                  batch_size: int = 256) -> np.ndarray:
    """Predictions for many items; Magnus goes through the embedding cache when one is given."""
    if getattr(model, "kind", "") == "magnus" and cache_dir is not None:
        x = magnus_feature_matrix(items, cache_dir, getattr(model, "encoder_path", None),
                                  dtype=getattr(model, "encoder_dtype", None))
        return model.predict_features(x)
    out = [model.predict(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]
    return np.concatenate(out) if out else np.zeros(0)
