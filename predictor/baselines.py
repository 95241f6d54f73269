"""Baselines every predictor is reported next to: predict-the-mean and input-length linear regression.

Both are a handful of numbers, so they are stored as JSON (``model.json``) next to the same
``meta.json`` the other predictors write: nothing to unpickle, nothing to trust.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from predictor.base import META_FILE, PredictItem

MODEL_FILE = "model.json"


def _write(directory: Path, kind: str, params: dict, meta: dict | None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / MODEL_FILE).write_text(json.dumps(params, indent=2))
    (directory / META_FILE).write_text(json.dumps({"kind": kind, **(meta or {})}, indent=2, default=str))


class MeanPredictor:
    """Predicts the mean training length for everyone (optionally per task when the task is known).

    Per-task means are only used when the item carries a task name seen in training; the gateway
    usually does not know the task, so the global mean is the honest baseline.
    """

    kind = "mean"

    def __init__(self, mean: float = 1.0) -> None:
        self.mean = float(mean)

    def fit(self, items: Sequence[PredictItem], targets: Sequence[float]) -> MeanPredictor:
        y = np.asarray(targets, dtype=float)
        self.mean = float(y.mean()) if y.size else 1.0
        return self

    def predict(self, items: Sequence[PredictItem]) -> np.ndarray:
        return np.full(len(items), max(self.mean, 1.0))

    def save(self, directory: Path, meta: dict | None = None) -> None:
        _write(directory, self.kind, {"mean": self.mean}, meta)

    @classmethod
    def load(cls, directory: Path) -> MeanPredictor:
        return cls(json.loads((Path(directory) / MODEL_FILE).read_text())["mean"])


class LinearLengthPredictor:
    """G' = a + b · L(p), ordinary least squares on the input length alone.

    This is the baseline Magnus is judged against: the paper's own observation is that input and
    output lengths correlate strongly for most applications, so semantics must add to that.
    """

    kind = "linear"

    def __init__(self, intercept: float = 1.0, slope: float = 0.0) -> None:
        self.intercept = float(intercept)
        self.slope = float(slope)

    def fit(self, items: Sequence[PredictItem], targets: Sequence[float]) -> LinearLengthPredictor:
        x = np.asarray([it.input_tokens for it in items], dtype=float)
        y = np.asarray(targets, dtype=float)
        if x.size >= 2 and np.std(x) > 0:
            self.slope, self.intercept = (float(v) for v in np.polyfit(x, y, 1))
        else:
            self.slope, self.intercept = 0.0, float(y.mean()) if y.size else 1.0
        return self

    def predict(self, items: Sequence[PredictItem]) -> np.ndarray:
        x = np.asarray([it.input_tokens for it in items], dtype=float)
        return np.maximum(self.intercept + self.slope * x, 1.0)

    def save(self, directory: Path, meta: dict | None = None) -> None:
        _write(directory, self.kind, {"intercept": self.intercept, "slope": self.slope}, meta)

    @classmethod
    def load(cls, directory: Path) -> LinearLengthPredictor:
        d = json.loads((Path(directory) / MODEL_FILE).read_text())
        return cls(d["intercept"], d["slope"])
