"""The Celery app: Redis broker, JSON only, late acks, prefetch 1, long visibility timeout.

The visibility timeout must be longer than the longest batch, or Redis hands a running batch
to a second worker; it is set in the broker, result-backend and app options (SPEC "Workers").
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery import Celery

from cohort.bus import queue_for_pool
from cohort.settings import Settings, get_settings
from cohort.types import Batch

RUN_BATCH = "cohort.run_batch"
LEARNING_QUEUE = "cohort.learning"
RETRAIN_TASKS = {"predictor": "cohort.retrain_predictor", "estimator": "cohort.retrain_estimator"}


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
            RUN_BATCH: {"queue": queue_for_pool(s.pool)},
            **{name: {"queue": LEARNING_QUEUE} for name in RETRAIN_TASKS.values()},
        },
        beat_schedule={
            "retrain-predictor": {"task": RETRAIN_TASKS["predictor"], "schedule": s.predictor_retrain_every_s},
            "retrain-estimator": {"task": RETRAIN_TASKS["estimator"], "schedule": s.estimator_retrain_every_s},
        },
    )
    return app


celery_app = make_celery()


def batch_sender(settings: Settings) -> Callable[[Batch], None]:
    """How the batcher hands a batch to its pool: the run_batch task on the pool's queue, with the
    batch id as the task id (a redelivery is recognised by it)."""
    queue = queue_for_pool(settings.pool)

    def send(batch: Batch) -> None:
        celery_app.send_task(RUN_BATCH, args=[batch.to_dict()], task_id=batch.id, queue=queue)

    return send


def enqueue_retrain(target: str) -> str:
    """Retrain the predictor or the estimator now, on the learning worker: the task id."""
    return celery_app.send_task(RETRAIN_TASKS[target], kwargs={"force": True}, queue=LEARNING_QUEUE).id


def task_status(task_id: str) -> dict[str, Any]:
    """A learning task's state from the result backend (PENDING also means: unknown id)."""
    res = celery_app.AsyncResult(task_id)
    out: dict[str, Any] = {"state": res.state}
    if res.successful():
        out["result"] = res.result
    elif res.failed():
        out["error"] = f"{type(res.result).__name__}: {res.result}"
    return out
