"""Fitting the linear step-time form (``step_time.FittedStepTime``) to measured steps.

Its own module because it needs NumPy and SciPy, which serving never does.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from scipy.optimize import nnls

from bench.engine_sim.step_time import FittedStepTime, StepShape


def fit_step_time(samples: Iterable[tuple[StepShape, float]]) -> FittedStepTime:
    """Least-squares coefficients of the linear form from (shape, seconds) samples, each kept
    non-negative (NNLS): a negative per-token cost would make a bigger step faster. Columns are
    scaled before solving, since tokens and rows differ by orders of magnitude."""
    rows = [(s.features(), t) for s, t in samples]
    if len(rows) < 4:
        raise ValueError(f"need at least 4 step samples to fit 4 coefficients, got {len(rows)}")
    x = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows], dtype=float)
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coef, _ = nnls(x / scale, y)
    a, b, c, d = (coef / scale).tolist()
    return FittedStepTime(a, b, c, d)
