"""Batch-time estimators: T_p from (β, L(B), G(B)).

``AnalyticBatchTime`` is the cold-start model (prefill grows with β·L, each decode step costs a
fixed part plus a part that grows with the KV read β·(L + g)). It is fitted by least squares
from a short profiling run (``fit``) and replaced by KNN once enough real batches are logged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np


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
        from scipy.optimize import nnls

        x = _design(np.asarray(shapes, dtype=float).reshape(-1, 3))
        coef, _ = nnls(x, np.asarray(seconds, dtype=float))
        return cls(*map(float, coef))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
