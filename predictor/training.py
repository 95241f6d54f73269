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


def fit_predictor(kind: str, items: Sequence[PredictItem], targets: Sequence[float],
                  cache_dir: str | Path | None = None, encoder_path: str | None = None,
                  show_progress: bool = False, **options: Any) -> LengthPredictor:
    """A trained predictor of ``kind``. ``options`` go to the model (e.g. n_estimators for magnus;
    base_model, max_examples, max_steps, epochs, edges, representative for lora)."""
    y = np.asarray(targets, dtype=float)
    if kind == "mean":
        from predictor.baselines import MeanPredictor

        return MeanPredictor().fit(items, y)
    if kind == "linear":
        from predictor.baselines import LinearLengthPredictor

        return LinearLengthPredictor().fit(items, y)
    if kind == "magnus":
        from predictor.data import magnus_feature_matrix
        from predictor.magnus import MagnusPredictor

        rf_keys = ("n_estimators", "max_depth", "min_samples_leaf", "seed")
        model = MagnusPredictor(encoder_path=encoder_path, **{k: options[k] for k in rf_keys if k in options})
        if options.get("max_features") is not None:  # share of features tried per split
            model.model.set_params(max_features=options["max_features"])
        x = magnus_feature_matrix(items, cache_dir, encoder_path, show_progress=show_progress)
        return model.fit(items, y, features=x)
    if kind == "magnus_fast":
        from predictor.magnus_fast import MagnusFastPredictor

        rf_keys = ("n_estimators", "max_depth", "min_samples_leaf", "seed")
        model = MagnusFastPredictor(encoder_path=encoder_path,
                                    **{k: options[k] for k in rf_keys if k in options})
        if options.get("max_features") is not None:
            model.model.set_params(max_features=options["max_features"])
        return model.fit(items, y)
    if kind == "lora":
        from predictor.lora import LoraBucketPredictor

        init_keys = ("base_model", "edges", "representative", "max_length", "lora_r", "lora_alpha",
                     "lora_dropout", "target_modules", "length_hint", "threads")
        fit_keys = ("epochs", "batch_size", "lr", "max_examples", "max_steps", "seed")
        model = LoraBucketPredictor(**{k: options[k] for k in init_keys if options.get(k) is not None})
        return model.fit(items, y, show_progress=show_progress,
                         **{k: options[k] for k in fit_keys if options.get(k) is not None})
    raise ValueError(f"unknown predictor kind {kind!r}")


def predict_items(model: LengthPredictor, items: Sequence[PredictItem], cache_dir: str | Path | None = None,
                  batch_size: int = 256) -> np.ndarray:
    """Predictions for many items; Magnus goes through the embedding cache when one is given."""
    if getattr(model, "kind", "") == "magnus" and cache_dir is not None:
        from predictor.data import magnus_feature_matrix

        x = magnus_feature_matrix(items, cache_dir, getattr(model, "encoder_path", None))
        return model.predict_features(x)
    out = [model.predict(items[i:i + batch_size]) for i in range(0, len(items), batch_size)]
    return np.concatenate(out) if out else np.zeros(0)
