"""The batch-time estimator as the batcher uses it: a ``BatchTimeModel`` that follows the registry.

Uses the registry's ACTIVE estimator version (KNN, trained by continuous learning) when there is
one; otherwise the analytic cold-start model, fitted from the profiling samples of
`cohort worker profile` when they exist (defaults otherwise). The ACTIVE file is checked at most
once a second (one ``stat``) and a new version is swapped in with a single assignment, so
``estimate_many`` always runs on one consistent model. Synchronous on purpose: the batcher's
scheduling loop is synchronous and a KNN query over a few thousand samples takes microseconds.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from cohort.settings import Settings
from predictor.estimator import AnalyticBatchTime, KNNBatchTime, load_estimator
from predictor.hotswap import HotSwap
from predictor.learning import cold_start_estimator
from predictor.registry import Registry

log = logging.getLogger(__name__)


class EstimatorService:
    """BatchTimeModel (estimate, estimate_many) with hot reload; ``version`` None = analytic."""

    def __init__(self, settings: Settings, reload_interval_s: float = 1.0) -> None:
        self.settings = settings
        self.registry = Registry(settings.data_dir, "estimator")
        self._swap: HotSwap[KNNBatchTime | AnalyticBatchTime] = HotSwap(
            "estimator", self._source, self._analytic(), reload_interval_s)
        self.maybe_reload(force=True)

    def _source(self):
        """The ACTIVE KNN version, or the analytic model when there is none."""
        mtime = self.registry.active_mtime()
        version = self.registry.active() if mtime is not None else None
        if version:
            return (version, mtime), version, lambda: load_estimator(self.registry.path(version))
        return (None, None), None, self._analytic

    def _analytic(self) -> AnalyticBatchTime:
        return cold_start_estimator(self.settings)

    @property
    def version(self) -> str | None:
        return self._swap.current[1]

    @property
    def model(self) -> KNNBatchTime | AnalyticBatchTime:
        return self._swap.current[0]

    def maybe_reload(self, force: bool = False) -> bool:
        """Swap in the ACTIVE version if it changed; back to analytic if ACTIVE disappeared."""
        return self._swap.maybe_reload(force)

    def estimate(self, size: int, input_len: int, gen_len: int) -> float:
        return float(self.estimate_many([(size, input_len, gen_len)])[0])

    def estimate_many(self, shapes: Sequence[tuple[int, int, int]]) -> np.ndarray:
        self.maybe_reload()
        return np.asarray(self._swap.current[0].estimate_many(shapes), dtype=float)
