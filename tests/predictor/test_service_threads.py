"""The gateway's predictor thread runs OpenMP with ``COHORT_PREDICTOR_THREADS`` threads: on a
request batch of a few rows, a gradient-boosted model's default team (one thread per core) spins
at every tree and took ~40× the CPU of one thread on the 2-core machine (docs/notes/retention.md)."""

from __future__ import annotations

import pytest
from threadpoolctl import threadpool_info

from predictor.service import PredictorService


def _openmp_threads() -> list[int]:
    import sklearn.ensemble  # noqa: F401  (loads scikit-learn's OpenMP runtime)

    return [i["num_threads"] for i in threadpool_info() if i["user_api"] == "openmp"]


def test_the_predictor_thread_runs_openmp_with_the_configured_threads(settings) -> None:
    if not _openmp_threads():
        pytest.skip("no OpenMP runtime loaded")
    svc = PredictorService(settings.model_copy(update={"predictor_threads": 1}))
    try:
        assert set(svc._executor.submit(_openmp_threads).result()) == {1}
    finally:
        svc._executor.shutdown(wait=True)
