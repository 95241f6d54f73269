"""Fitting the linear step-time forms (``step_time.FittedStepTime``) to measured steps.

Its own module because it needs NumPy and SciPy, which serving never does.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from scipy.optimize import lsq_linear

from bench.engine_sim.step_time import FIT_FORM, FORMS, FittedStepTime, StepShape


def fit_step_time(samples: Iterable[tuple[StepShape, float]], form: str = FIT_FORM,
                  relative: bool = False) -> FittedStepTime:
    """Least-squares coefficients of ``form`` (linear-v1 or linear-v2) from (shape, seconds)
    samples, each kept non-negative (bounded least squares): a negative per-token cost would make a bigger step
    faster. Columns are scaled before solving, since tokens and rows differ by orders of
    magnitude. ``relative``: minimise the relative residuals (each sample weighted by 1/t), so
    short steps count as much as long ones."""
    return fit_step_runs((((s,), t) for s, t in samples), form, relative)


def fit_step_runs(samples: Iterable[tuple[Sequence[StepShape], float]], form: str = FIT_FORM,
                  relative: bool = False) -> FittedStepTime:
    """``fit_step_time`` from runs of consecutive steps, each timed as a whole: the forms are
    linear, so a run's time is its steps' features summed times the coefficients."""
    if form not in FORMS:
        raise ValueError(f"unknown step-time form {form!r}; one of {FORMS}")
    rows = [(np.sum([s.features(form) for s in shapes], axis=0), t) for shapes, t in samples]
    k = len(StepShape().features(form))
    if len(rows) < k:
        raise ValueError(f"need at least {k} step samples to fit {k} coefficients, got {len(rows)}")
    x = np.array([r[0] for r in rows], dtype=float)
    y = np.array([r[1] for r in rows], dtype=float)
    return FittedStepTime.of(form, solve_nonnegative(x, y, relative))


def solve_nonnegative(x: np.ndarray, y: np.ndarray, relative: bool = False) -> list[float]:
    """Non-negative least-squares coefficients of y ≈ x · coef (``relative``: of y's relative
    residuals). Columns are scaled first: tokens and rows differ by orders of magnitude."""
    if relative:
        w = 1.0 / np.maximum(y, 1e-9)
        x, y = x * w[:, None], y * w
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    # bounded-variable least squares: exact, where scipy's nnls can stop at its iteration cap on
    # nearly collinear columns (a constant per step and one per prefill step, in runs of steps)
    coef = lsq_linear(x / scale, y, bounds=(0.0, np.inf), method="bvls").x
    return (coef / scale).tolist()


def fit_errors(fit: FittedStepTime, samples: list[tuple[Sequence[StepShape], float]]) -> dict[str, Any]:
    """|predicted − measured| / measured over runs of steps: median, p90, mean, for all runs and
    apart for runs with and without a prefill step."""
    def stats(sel: list[tuple[Sequence[StepShape], float]]) -> dict[str, Any]:
        err = np.array([abs(sum(map(fit.seconds, s)) - t) / t for s, t in sel if t > 0])
        if not len(err):
            return {"samples": 0}
        return {"samples": len(err), "median": float(np.median(err)), "p90": float(np.percentile(err, 90)),
                "mean": float(err.mean())}

    def has_prefill(shapes: Sequence[StepShape]) -> bool:
        return any(s.prefill_tokens for s in shapes)
    return {"all": stats(samples), "decode_only": stats([p for p in samples if not has_prefill(p[0])]),
            "with_prefill": stats([p for p in samples if has_prefill(p[0])])}
