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
from predictor.learning import RetrainRunning, load_state, retrain_estimator, retrain_predictor
from taskq.celery_app import RETENTION_TASK, RETRAIN_TASKS, celery_app

log = logging.getLogger(__name__)


def _retrain(name: str, retrain: Callable[..., dict[str, Any]], force: bool,
             requested_at: float | None = None) -> dict[str, Any]:
    """Run one retraining; one already running for the same target makes this one a no-op
    (skipped, never queued behind it: predictor.learning._lock), and one that waited in the
    queue while a retrain of its target *started* after it was requested is coalesced into that
    one (it saw every sample logged before the request): admin requests never stack up fits."""
    settings = get_settings()
    target = name.removeprefix("retrain_")
    started = float(load_state(settings).get(f"{target}_started", 0.0))
    if requested_at is not None and started > requested_at:
        log.info("%s coalesced: a retrain started %.1f s after it was requested", name, started - requested_at)
        return {"retrained": False, "coalesced": True}
    try:
        with thread_limits(learner_threads(settings.learning.cpu_share)):
            out = retrain(settings, force=force)
    except RetrainRunning as e:
        log.info("%s skipped: %s", name, e)
        return {"retrained": False, "skipped": str(e)}
    log.info("%s: %s", name, {k: out.get(k) for k in ("version", "n_added", "retrained")})
    return out


@celery_app.task(name=RETRAIN_TASKS["predictor"], ignore_result=False, acks_late=True)
def retrain_predictor_task(force: bool = False, requested_at: float | None = None) -> dict[str, Any]:
    """Add mispredicted requests from the log DB to the training set, retrain, activate."""
    return _retrain("retrain_predictor", retrain_predictor, force, requested_at)


@celery_app.task(name=RETRAIN_TASKS["estimator"], ignore_result=False, acks_late=True)
def retrain_estimator_task(force: bool = False, requested_at: float | None = None) -> dict[str, Any]:
    """Add badly estimated batches from the log DB to the sample set, refit KNN, activate."""
    return _retrain("retrain_estimator", retrain_estimator, force, requested_at)


@celery_app.task(name=RETENTION_TASK, ignore_result=False, acks_late=True)
def retention_task() -> dict[str, Any]:
    """Apply every retention bound (log DB, prompts, versions, training stores, caches)."""
    out = retention_pass(get_settings())
    log.info("retention: %s", out)
    return out
