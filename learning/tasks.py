"""Celery tasks for continuous learning, run on the "learning" queue by beat (every 3 / 2 min)
and never on the request path. Each returns the JSON-serialisable result of the retraining
(version, metrics, n_added), so a caller can wait for it if it wants to."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from cohort.settings import get_settings
from learning.cpu import learner_threads, thread_limits
from learning.retention import retention_pass
from predictor.learning import RetrainRunning, retrain_estimator, retrain_predictor
from taskq.celery_app import RETENTION_TASK, RETRAIN_TASKS, celery_app

log = logging.getLogger(__name__)


def _retrain(name: str, retrain: Callable[..., dict[str, Any]], force: bool) -> dict[str, Any]:
    """Run one retraining; one already running for the same target makes this one a no-op
    (skipped, never queued behind it: predictor.learning._lock)."""
    settings = get_settings()
    try:
        with thread_limits(learner_threads(settings.learning_cpu_share)):
            out = retrain(settings, force=force)
    except RetrainRunning as e:
        log.info("%s skipped: %s", name, e)
        return {"retrained": False, "skipped": str(e)}
    log.info("%s: %s", name, {k: out.get(k) for k in ("version", "n_added", "retrained")})
    return out


@celery_app.task(name=RETRAIN_TASKS["predictor"], ignore_result=False, acks_late=True)
def retrain_predictor_task(force: bool = False) -> dict[str, Any]:
    """Add mispredicted requests from the log DB to the training set, retrain, activate."""
    return _retrain("retrain_predictor", retrain_predictor, force)


@celery_app.task(name=RETRAIN_TASKS["estimator"], ignore_result=False, acks_late=True)
def retrain_estimator_task(force: bool = False) -> dict[str, Any]:
    """Add badly estimated batches from the log DB to the sample set, refit KNN, activate."""
    return _retrain("retrain_estimator", retrain_estimator, force)


@celery_app.task(name=RETENTION_TASK, ignore_result=False, acks_late=True)
def retention_task() -> dict[str, Any]:
    """Apply every retention bound (log DB, prompts, versions, training stores, caches)."""
    out = retention_pass(get_settings())
    log.info("retention: %s", out)
    return out
