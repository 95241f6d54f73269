"""The learning worker's commands, which ``launch`` mounts as ``cohort worker learning`` and
``cohort worker beat``: a Celery worker on the retraining queue, and beat, which sends the
periodic retrains."""

from __future__ import annotations

import logging
from pathlib import Path

from cohort.settings import get_settings
from learning.cpu import apply_cpu_share
from taskq.celery_app import LEARNING_QUEUE, celery_app


def _setup_logging() -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


def learning() -> None:
    """A worker for the retraining queue (off the request path), at low priority with a capped
    share of the cores (learning.cpu: threads, nice, duty cycle) before anything loads torch."""
    _setup_logging()
    s = get_settings()
    apply_cpu_share(s.learning.cpu_share, s.learning.nice)
    celery_app.worker_main(["worker", "--pool=solo", "--concurrency=1", "-Q", LEARNING_QUEUE,
                            "-n", "learning@%h", "--loglevel=INFO", "--without-gossip", "--without-mingle",
                            "--without-heartbeat"])


def beat(schedule_file: Path = Path("var/celerybeat-schedule")) -> None:
    """Celery beat: triggers predictor (3 min) and estimator (2 min) retraining, and the
    retention pass (COHORT_RETENTION__EVERY_S)."""
    _setup_logging()
    schedule_file.parent.mkdir(parents=True, exist_ok=True)
    celery_app.start(["beat", "--loglevel=INFO", "-s", str(schedule_file)])
