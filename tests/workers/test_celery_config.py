"""The Celery settings the 'nothing lost' guarantee rests on."""

from __future__ import annotations

from cohort.bus import queue_for_pool
from taskq.celery_app import make_celery


def test_json_only_late_acks_prefetch_one_and_visibility_timeout(monkeypatch):
    monkeypatch.setenv("COHORT_VISIBILITY_TIMEOUT_S", "7200")
    from cohort.settings import get_settings

    get_settings.cache_clear()
    try:
        conf = make_celery().conf
    finally:
        get_settings.cache_clear()
    assert conf.task_serializer == conf.result_serializer == "json"
    assert list(conf.accept_content) == ["json"]
    assert conf.task_acks_late and conf.task_reject_on_worker_lost
    assert conf.worker_prefetch_multiplier == 1
    for opts in (conf.broker_transport_options, conf.result_backend_transport_options):
        assert opts["visibility_timeout"] == 7200
    assert conf.visibility_timeout == 7200
    assert conf.task_routes["cohort.run_batch"]["queue"] == queue_for_pool("default")
    assert conf.task_routes["cohort.retrain_predictor"]["queue"] == "cohort.learning"
    assert conf.task_routes["cohort.retention"]["queue"] == "cohort.learning"
    assert {e["task"] for e in conf.beat_schedule.values()} == {"cohort.retrain_predictor",
                                                               "cohort.retrain_estimator", "cohort.retention"}


def test_settings_are_read_when_first_needed_or_taken_as_given(monkeypatch):
    """No settings are built when the app is made (the module's import makes one); given
    settings win over the environment."""
    from cohort.settings import Settings, get_settings

    monkeypatch.setenv("COHORT_VISIBILITY_TIMEOUT_S", "7300")
    get_settings.cache_clear()
    try:
        app = make_celery()
        assert not app.configured and get_settings.cache_info().currsize == 0
        assert app.conf.visibility_timeout == 7300 and get_settings.cache_info().currsize == 1
    finally:
        get_settings.cache_clear()
    given = make_celery(Settings(visibility_timeout_s=900, pool="second", redis_url="redis://h:1/3"))
    assert given.conf.visibility_timeout == 900 and given.conf.broker_url == "redis://h:1/3"
    assert given.conf.task_default_queue == queue_for_pool("second")


def test_the_batcher_sends_batches_without_waiting_on_their_results(monkeypatch):
    """A batch's answer comes back through Redis streams and a completion event: the sender must not
    subscribe to the task's result channel (Celery's Redis backend does so unless told to ignore it)."""
    from cohort.settings import Settings
    from cohort.types import Batch
    from taskq import celery_app as ca

    sent: list[dict] = []
    monkeypatch.setattr(ca.celery_app, "send_task", lambda name, **kw: sent.append({"name": name, **kw}))
    send = ca.batch_sender(Settings(pool="p"))
    send(Batch(id="b1", requests=[], created=0.0))
    send(Batch(id="b2", requests=[], created=0.0), "inst-1")
    assert [s["task_id"] for s in sent] == ["b1", "b2"]
    assert [s["queue"] for s in sent] == [queue_for_pool("p"), ca.queue_for_instance("inst-1")]
    assert all(s["ignore_result"] is True for s in sent)
    assert all(s["name"] == ca.RUN_BATCH for s in sent)
