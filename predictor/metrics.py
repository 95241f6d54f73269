"""Quality metrics of a length predictor, as the SPEC reports them.

All take (actual, predicted) token counts. Bucket accuracy uses the UELLM buckets so a
regressor and the bucket classifier are compared on the same footing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from scipy.stats import kendalltau

from predictor.buckets import DEFAULT_EDGES, bucket_index

METRIC_KEYS = ("n", "mae", "rmse", "pearson", "kendall_tau", "bucket_accuracy", "acc_within_50",
               "acc_within_100")


def _arr(x: Sequence[float] | np.ndarray) -> np.ndarray:
    return np.asarray(x, dtype=float).ravel()


def mae(actual, predicted) -> float:
    a, p = _arr(actual), _arr(predicted)
    return float(np.mean(np.abs(a - p))) if a.size else float("nan")


def rmse(actual, predicted) -> float:
    a, p = _arr(actual), _arr(predicted)
    return float(np.sqrt(np.mean((a - p) ** 2))) if a.size else float("nan")


def pearson(actual, predicted) -> float:
    """Pearson r; NaN when either side is constant (r is undefined, not zero)."""
    a, p = _arr(actual), _arr(predicted)
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(p) == 0:
        return float("nan")
    return float(np.corrcoef(a, p)[0, 1])


def kendall_tau(actual, predicted) -> float:
    """Kendall tau-b (ties handled), via scipy."""

    a, p = _arr(actual), _arr(predicted)
    if a.size < 2 or np.ptp(a) == 0 or np.ptp(p) == 0:
        return float("nan")
    return float(kendalltau(a, p).statistic)


def bucket_accuracy(actual, predicted, edges: Sequence[int] = DEFAULT_EDGES) -> float:
    """Share of requests whose predicted length falls in the same bucket as the actual one."""
    a, p = _arr(actual), _arr(predicted)
    if not a.size:
        return float("nan")
    return float(np.mean(bucket_index(a, edges) == bucket_index(p, edges)))


def acc_within(actual, predicted, tol: float) -> float:
    """Share of requests predicted within ±tol tokens."""
    a, p = _arr(actual), _arr(predicted)
    return float(np.mean(np.abs(a - p) <= tol)) if a.size else float("nan")


def all_metrics(actual, predicted, edges: Sequence[int] = DEFAULT_EDGES) -> dict[str, float]:
    """The metric dict M of the eval JSON: n, mae, rmse, pearson, kendall_tau, bucket_accuracy,
    acc_within_50, acc_within_100. NaN values become None so the JSON stays valid."""
    a, p = _arr(actual), _arr(predicted)
    m = {
        "n": int(a.size),
        "mae": mae(a, p),
        "rmse": rmse(a, p),
        "pearson": pearson(a, p),
        "kendall_tau": kendall_tau(a, p),
        "bucket_accuracy": bucket_accuracy(a, p, edges),
        "acc_within_50": acc_within(a, p, 50),
        "acc_within_100": acc_within(a, p, 100),
    }
    return {k: (None if isinstance(v, float) and np.isnan(v) else v) for k, v in m.items()}
