"""The Celery app: Redis broker, JSON only, late acks, prefetch 1, long visibility timeout.

The visibility timeout must be longer than the longest batch, or Redis hands a running batch
to a second worker; it is set in the broker, result-backend and app options (SPEC "Workers").
"""

from __future__ import annotations

from collections.abc import Callable

from celery import Celery

from cohort.bus import queue_for_pool
from cohort.settings import Settings, get_settings
from cohort.types import Batch


def make_celery() -> Celery:
    s = get_settings()
    url = s.redis_url or "redis://127.0.0.1:6379/0"  # only used when a task is actually sent
    transport = {"visibility_timeout": s.visibility_timeout_s}
    app = Celery("cohort", broker=url, backend=url,
                 include=["workers.tasks", "workers.learning_tasks"])
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        event_serializer="json",
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_ignore_result=True,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
        visibility_timeout=s.visibility_timeout_s,
        broker_connection_retry_on_startup=True,
        worker_hijack_root_logger=False,
        task_default_queue=queue_for_pool(s.pool),
        task_routes={
            "cohort.run_batch": {"queue": queue_for_pool(s.pool)},
            "cohort.retrain_predictor": {"queue": "cohort.learning"},
            "cohort.retrain_estimator": {"queue": "cohort.learning"},
        },
        beat_schedule={
            "retrain-predictor": {"task": "cohort.retrain_predictor",
                                  "schedule": s.predictor_retrain_every_s},
            "retrain-estimator": {"task": "cohort.retrain_estimator",
                                  "schedule": s.estimator_retrain_every_s},
        },
    )
    return app


celery_app = make_celery()


def batch_sender(settings: Settings) -> Callable[[Batch], None]:
    """How the batcher hands a batch to its pool: the run_batch task on the pool's queue, with the
    batch id as the task id (a redelivery is recognised by it)."""
    queue = queue_for_pool(settings.pool)

    def send(batch: Batch) -> None:
        celery_app.send_task("cohort.run_batch", args=[batch.to_dict()], task_id=batch.id, queue=queue)

    return send
