"""The Celery app: Redis broker, JSON only, late acks, prefetch 1, long visibility timeout.

The visibility timeout must be longer than the longest batch, or Redis hands a running batch
to a second worker; it is set in the broker, result-backend and app options (SPEC "Workers").

The app exists at import (the task modules decorate their functions with it) but holds no
settings until an entry point passes them (``configure_celery``); a process that never does —
``celery -A taskq.celery_app:celery_app flower`` in docker-compose — reads them from the
environment when Celery first looks at its configuration, not when this module is imported.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from celery import Celery

from cohort.bus import queue_for_instance, queue_for_pool
from cohort.settings import Settings, get_settings
from cohort.types import Batch

RUN_BATCH = "cohort.run_batch"
LEARNING_QUEUE = "cohort.learning"
RETRAIN_TASKS = {"predictor": "cohort.retrain_predictor", "estimator": "cohort.retrain_estimator"}
RETENTION_TASK = "cohort.retention"  # the periodic retention pass (learning.retention)


def celery_config(s: Settings) -> dict[str, Any]:
    """The Celery configuration for one set of settings."""
    url = s.redis_url or "redis://127.0.0.1:6379/0"  # only used when a task is actually sent
    transport = {"visibility_timeout": s.visibility_timeout_s}
    return {
        "broker_url": url,
        "result_backend": url,
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_ignore_result": True,
        "broker_transport_options": transport,
        "result_backend_transport_options": transport,
        "visibility_timeout": s.visibility_timeout_s,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "task_default_queue": queue_for_pool(s.pool),
        "task_routes": {
            RUN_BATCH: {"queue": queue_for_pool(s.pool)},
            **{name: {"queue": LEARNING_QUEUE} for name in (*RETRAIN_TASKS.values(), RETENTION_TASK)},
        },
        "beat_schedule": {
            # A periodic retrain not started within its period expires: it never piles up behind a
            # long one (and one that starts while another runs is skipped: predictor.learning._lock).
            "retrain-predictor": {"task": RETRAIN_TASKS["predictor"], "schedule": s.learning.predictor_every_s,
                                  "options": {"expires": s.learning.predictor_every_s}},
            "retrain-estimator": {"task": RETRAIN_TASKS["estimator"], "schedule": s.learning.estimator_every_s,
                                  "options": {"expires": s.learning.estimator_every_s}},
            "retention": {"task": RETENTION_TASK, "schedule": s.retention.every_s,
                          "options": {"expires": s.retention.every_s}},
        },
    }


class _SettingsPromise:
    """Celery's lazy defaults: the configuration of the settings handed over by then, else of
    the environment's, computed when Celery first reads its configuration."""

    def __init__(self, settings: Settings | None = None) -> None:
        self.settings = settings

    def __call__(self) -> dict[str, Any]:
        return celery_config(self.settings or get_settings())


def make_celery(settings: Settings | None = None, promise: _SettingsPromise | None = None) -> Celery:
    """A Celery app configured from ``settings``, or, when none are given, from the environment
    the first time its configuration is read (nothing is read at construction)."""
    app = Celery("cohort", include=["workers.tasks", "learning.tasks"])
    app.add_defaults(promise or _SettingsPromise(settings))
    return app


_promise = _SettingsPromise()
celery_app = make_celery(promise=_promise)


def configure_celery(settings: Settings) -> None:
    """Hand an entry point's settings to the process's app, before or after its configuration
    was first read."""
    _promise.settings = settings
    if celery_app.configured:
        celery_app.conf.update(celery_config(settings))


def batch_sender(settings: Settings) -> Callable[[Batch, str | None], None]:
    """How the batcher hands a batch to its pool: the ``cohort.run_batch`` task on the pool's queue, or on one
    instance's own queue when the batcher routed it there, with the batch id as the task id (a redelivery
    is recognised by it). Its result is never read (the worker answers through Redis streams and a
    completion event), so the sender does not subscribe to it: Celery's Redis backend otherwise
    subscribes the sender to every task's result channel, a round trip per batch and one more
    channel held for each (a fifth of the batcher's samples in a burst, docs/notes/upstream.md)."""
    pool_queue = queue_for_pool(settings.pool)

    def send(batch: Batch, instance: str | None = None) -> None:
        queue = pool_queue if instance is None else queue_for_instance(instance)
        # argsrepr: what Celery logs and monitors show of the task, named instead of formatting the
        # whole batch (saferepr of every request was 5 % of the batcher's CPU under load)
        celery_app.send_task(RUN_BATCH, args=[batch.to_dict()], task_id=batch.id, queue=queue, ignore_result=True,
                             argsrepr=f"[<batch {batch.id}: {batch.size} request(s)>]")

    return send


def enqueue_retrain(target: str) -> str:
    """Retrain the predictor or the estimator now, on the learning worker: the task id. The
    request time travels with it: a retrain of the same target that starts after it covers it,
    so this one is then coalesced into that one instead of fitting again (learning.tasks)."""
    return celery_app.send_task(RETRAIN_TASKS[target], kwargs={"force": True, "requested_at": time.time()},
                                queue=LEARNING_QUEUE).id


def task_status(task_id: str) -> dict[str, Any]:
    """A learning task's state from the result backend (PENDING also means: unknown id)."""
    res = celery_app.AsyncResult(task_id)
    out: dict[str, Any] = {"state": res.state}
    if res.successful():
        out["result"] = res.result
    elif res.failed():
        out["error"] = f"{type(res.result).__name__}: {res.result}"
    return out
