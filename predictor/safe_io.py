"""Model files (skops): the one place that writes and reads them, with an explicit allow-list.

skops refuses to instantiate types it does not trust; beyond its own defaults our models need
only the four scikit-learn internals below (forest trees, histogram-boosting predictors, the KNN
estimator's KD-tree and metric). Anything else in a file — a type merely *named* like a
scikit-learn one included — is refused: a model file is never a way to run code.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TRUSTED_TYPES = frozenset({
    "sklearn.tree._tree.Tree",                                             # random forests (Magnus)
    "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",    # the semantic predictor
    "sklearn.neighbors._kd_tree.KDTree",                                   # the KNN batch-time model
    "sklearn.metrics._dist_metrics.EuclideanDistance64",
})


def _skops():
    # skops enumerates scikit-learn's types on import (and through them imports torch when it is
    # installed): seconds that a process which never reads or writes a model file should not pay.
    import skops.io as sio

    return sio


def dump(obj: Any, path: str | Path) -> None:
    _skops().dump(obj, Path(path))


def load(path: str | Path) -> Any:
    """The object in ``path``; raises ValueError naming any type outside the allow-list."""
    path, sio = Path(path), _skops()
    needed = sio.get_untrusted_types(file=path)
    refused = sorted(set(needed) - TRUSTED_TYPES)
    if refused:
        raise ValueError(f"{path}: refusing to load types outside the allow-list: {refused}")
    return sio.load(path, trusted=needed)
