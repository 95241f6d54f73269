"""Celery tasks for continuous learning, run on the "learning" queue by beat (every 3 / 2 min)
and never on the request path. Each returns the JSON-serialisable result of the retraining
(version, metrics, n_added), so a caller can wait for it if it wants to."""

from __future__ import annotations

import logging
from typing import Any

from cohort.settings import get_settings
from predictor.learning import RetrainRunning, retrain_estimator, retrain_predictor
from taskq.celery_app import RETRAIN_TASKS, celery_app

log = logging.getLogger(__name__)


@celery_app.task(name=RETRAIN_TASKS["predictor"], ignore_result=False, acks_late=True)
def retrain_predictor_task(force: bool = False) -> dict[str, Any]:
    """Add mispredicted requests from the log DB to the training set, retrain, activate."""
    try:
        out = retrain_predictor(get_settings(), force=force)
    except RetrainRunning as e:
        log.info("retrain_predictor skipped: %s", e)
        return {"retrained": False, "skipped": str(e)}
    log.info("retrain_predictor: %s", {k: out.get(k) for k in ("version", "n_added", "retrained")})
    return out


@celery_app.task(name=RETRAIN_TASKS["estimator"], ignore_result=False, acks_late=True)
def retrain_estimator_task(force: bool = False) -> dict[str, Any]:
    """Add badly estimated batches from the log DB to the sample set, refit KNN, activate."""
    try:
        out = retrain_estimator(get_settings(), force=force)
    except RetrainRunning as e:
        log.info("retrain_estimator skipped: %s", e)
        return {"retrained": False, "skipped": str(e)}
    log.info("retrain_estimator: %s", {k: out.get(k) for k in ("version", "n_added", "retrained")})
    return out
