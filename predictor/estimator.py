"""Batch-time estimators: T_p from (β, L(B), G(B)).

``AnalyticBatchTime`` is the cold-start model (prefill grows with β·L, each decode step costs a
fixed part plus a part that grows with the KV read β·(L + g)). It is fitted by least squares
from a short profiling run (``fit``) and replaced by KNN once enough real batches are logged.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import nnls
from sklearn.neighbors import KNeighborsRegressor
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from predictor import safe_io
from predictor.base import META_FILE


def _design(shapes: np.ndarray) -> np.ndarray:
    """Columns: 1, β·L (prefill), G (per-step overhead), β·G·(L + G/2) (KV reads during decode)."""
    b, L, G = shapes[:, 0], shapes[:, 1], shapes[:, 2]
    return np.stack([np.ones_like(b), b * L, G, b * G * (L + G / 2.0)], axis=1)


@dataclass
class AnalyticBatchTime:
    """T = c0 + c1·β·L + c2·G + c3·β·G·(L + G/2), seconds. Defaults fit the tiny CPU model roughly."""

    c0: float = 0.01
    c1: float = 2e-6
    c2: float = 4e-3
    c3: float = 2e-8

    def estimate(self, size: int, input_len: int, gen_len: int) -> float:
        return float(self.estimate_many([(size, input_len, gen_len)])[0])

    def estimate_many(self, shapes: Sequence[tuple[int, int, int]]) -> np.ndarray:
        x = _design(np.asarray(shapes, dtype=float).reshape(-1, 3))
        return np.maximum(x @ np.array([self.c0, self.c1, self.c2, self.c3]), 1e-4)

    @classmethod
    def fit(cls, shapes: Sequence[tuple[int, int, int]], seconds: Sequence[float]) -> AnalyticBatchTime:
        """Non-negative least squares on profiled (β, L, G) → wall seconds."""

        x = _design(np.asarray(shapes, dtype=float).reshape(-1, 3))
        coef, _ = nnls(x, np.asarray(seconds, dtype=float))
        return cls(*map(float, coef))

    @classmethod
    def from_samples(cls, samples: Sequence[dict]) -> AnalyticBatchTime | None:
        """Fitted to profiling samples ({size, input_len, gen_len, seconds}); None with fewer than
        4 (four coefficients: underdetermined). The one cold-start fit."""
        if len(samples) < 4:
            return None
        return cls.fit([(s["size"], s["input_len"], s["gen_len"]) for s in samples], [s["seconds"] for s in samples])

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


KNN_MODEL_FILE = "model.skops"
ANALYTIC_MODEL_FILE = "analytic.json"


class KNNBatchTime:
    """Magnus's estimator: k-nearest-neighbour regression on standardised (β, L(B), G(B)).

    Batches with similar size, input length and generation length run a similar number of
    iterations with similar memory traffic, so their wall times are similar (Magnus §III-C).
    Standardising matters: β is tens while L and G are hundreds, and unscaled distances would
    ignore β. Distance weighting makes an exact repeat of a logged shape return its own time.
    Stored with skops (no pickle).

    Estimates are remembered per shape (exact: a fitted model maps a shape to one time). The
    batcher asks for the same open groups' shapes at every dispatch, and one scikit-learn
    neighbour query costs about a millisecond whatever its size: in the steady soak those queries
    were half the batcher's CPU once the first estimator went live (docs/notes/steady.md).
    """

    kind = "knn"
    MEMO = 65536  # shapes remembered; past it the memo starts over

    def __init__(self, n_neighbors: int = 5) -> None:
        self.n_neighbors = int(n_neighbors)
        self.model = make_pipeline(StandardScaler(),
                                   KNeighborsRegressor(n_neighbors=self.n_neighbors, weights="distance"))
        self.n_samples = 0
        self._memo: dict[tuple[float, float, float], float] = {}
        self._fast: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None = None

    def fit(self, shapes: Sequence[tuple[int, int, int]], seconds: Sequence[float]) -> KNNBatchTime:
        x = np.asarray(shapes, dtype=float).reshape(-1, 3)
        y = np.asarray(seconds, dtype=float)
        if len(x) == 0:
            raise ValueError("KNNBatchTime needs at least one sample")
        k = min(self.n_neighbors, len(x))
        self.model.set_params(kneighborsregressor__n_neighbors=k)
        self.model.fit(x, y)
        self.n_samples = len(x)
        self._memo, self._fast = {}, None
        return self

    def estimate(self, size: int, input_len: int, gen_len: int) -> float:
        return float(self.estimate_many([(size, input_len, gen_len)])[0])

    def estimate_many(self, shapes: Sequence[tuple[int, int, int]]) -> np.ndarray:
        x = np.asarray(shapes, dtype=float).reshape(-1, 3)
        if not len(x):
            return np.zeros(0)
        keys = [tuple(row) for row in x.tolist()]
        missing = list(dict.fromkeys(k for k in keys if k not in self._memo))
        if missing:
            if len(self._memo) + len(missing) > self.MEMO:
                self._memo, missing = {}, list(dict.fromkeys(keys))
            fresh = np.maximum(self._predict(np.asarray(missing, dtype=float)), 1e-4)
            self._memo.update(zip(missing, fresh.tolist(), strict=True))
        return np.array([self._memo[k] for k in keys])

    def _predict(self, x: np.ndarray) -> np.ndarray:
        """The fitted pipeline's prediction, computed with NumPy on its own arrays (the scaler's
        mean and scale, the neighbours' standardised shapes and times): scikit-learn's query
        costs about a millisecond whatever its size, and in continuous execution every arrival
        changes an open group's shape, so the memo misses at most dispatches (the batcher spent
        half its CPU there in docs/notes/steady.md run 10). Same rule: the k nearest by Euclidean
        distance, weighted by 1/distance, an exact repeat of a logged shape its own time."""
        arrays = self._arrays()
        if arrays is None:
            return self.model.predict(x)
        mean, scale, columns, times, k = arrays
        z = (x - mean) / scale
        sq = np.zeros((len(z), columns.shape[1]))
        for j, col in enumerate(columns):  # feature by feature: cheaper than one [m, n, 3] array
            sq += (z[:, j:j + 1] - col[None, :]) ** 2
        dist = np.sqrt(sq)
        near = (np.argpartition(dist, k - 1, axis=1)[:, :k] if k < columns.shape[1]
                else np.broadcast_to(np.arange(columns.shape[1]), dist.shape))
        d = np.take_along_axis(dist, near, axis=1)
        exact = d == 0
        with np.errstate(divide="ignore"):
            w = np.where(exact.any(axis=1, keepdims=True), exact.astype(float), 1.0 / d)
        return (w * times[near]).sum(axis=1) / w.sum(axis=1)

    def _arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, int] | None:
        """(scaler mean, scaler scale, standardised shapes by feature, times, k) of the fitted
        pipeline, read once per fit or load; None where it is not the standard one."""
        if self._fast is None:
            scaler, knn = self.model[0], self.model[-1]
            train, times = getattr(knn, "_fit_X", None), getattr(knn, "_y", None)
            if (len(self.model) != 2 or not isinstance(scaler, StandardScaler) or train is None or times is None
                    or np.ndim(times) != 1 or knn.weights != "distance" or knn.metric not in ("minkowski", "euclidean")
                    or (knn.metric == "minkowski" and knn.p != 2)):
                return None
            mean = scaler.mean_ if scaler.with_mean else np.zeros(train.shape[1])
            scale = scaler.scale_ if scaler.with_std else np.ones(train.shape[1])
            self._fast = (mean, scale, np.ascontiguousarray(np.asarray(train, dtype=float).T),
                          np.asarray(times, dtype=float), min(knn.n_neighbors, len(train)))
        return self._fast

    def save(self, directory, meta: dict | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        safe_io.dump(self.model, directory / KNN_MODEL_FILE)
        info = {"kind": self.kind, "n_neighbors": self.n_neighbors, "n_samples": self.n_samples,
                **(meta or {})}
        (directory / META_FILE).write_text(json.dumps(info, indent=2, default=str))

    @classmethod
    def load(cls, directory) -> KNNBatchTime:
        directory = Path(directory)
        meta = json.loads((directory / META_FILE).read_text())
        path = directory / KNN_MODEL_FILE
        self = cls(n_neighbors=meta.get("n_neighbors", 5))
        self.model = safe_io.load(path)
        self.n_samples = int(meta.get("n_samples", 0))
        return self


def save_analytic(model: AnalyticBatchTime, directory, meta: dict | None = None) -> None:
    """An analytic estimator as a registry-style directory (JSON coefficients + meta.json)."""

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / ANALYTIC_MODEL_FILE).write_text(json.dumps(model.to_dict(), indent=2))
    (directory / META_FILE).write_text(json.dumps({"kind": "analytic", **(meta or {})}, indent=2,
                                                  default=str))


def load_estimator(directory) -> KNNBatchTime | AnalyticBatchTime:
    """Load an estimator directory by its meta kind (knn | analytic)."""

    directory = Path(directory)
    kind = json.loads((directory / META_FILE).read_text()).get("kind")
    if kind == "knn":
        return KNNBatchTime.load(directory)
    if kind == "analytic":
        return AnalyticBatchTime(**json.loads((directory / ANALYTIC_MODEL_FILE).read_text()))
    raise ValueError(f"{directory}: unknown estimator kind {kind!r}")
