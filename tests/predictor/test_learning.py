import json
import time

import pytest

from cohort.logdb import get_db_engine, record_batch, record_request
from predictor import learning
from predictor.registry import Registry


def test_predictor_rule():
    f = learning.predictor_needs_sample
    assert not f(100, 109)          # 9 tokens: under the absolute threshold
    assert not f(1000, 1080)        # 80 tokens but 7.4 % of actual
    assert f(100, 120)              # 20 tokens and 16.7 %
    assert not f(100, 110)          # exactly 10 tokens is not > 10
    assert f(50, 5)                 # 45 tokens, 900 %
    assert f(None, 5)               # no prediction at all
    assert not f(30, 20, abs_tokens=15)


def test_estimator_rule():
    f = learning.estimator_needs_sample
    assert not f(1.0, 2.5)          # 1.5 s
    assert not f(20.0, 23.0)        # 3 s but 13 %
    assert f(10.0, 13.0)            # 3 s and 23 %
    assert f(5.0, 2.0)              # 3 s and 150 %
    assert not f(12.0, 10.0)        # 2 s exactly is not > 2
    rows = [{"batch_time_s": 13.0}, {"batch_time_s": 2.0}, {"batch_time_s": None}]
    assert learning.select_estimator_rows(rows, [10.0, 1.9, 5.0]) == [rows[0]]


def test_select_predictor_rows():
    rows = [{"id": "a", "predicted_tokens": 10, "actual_tokens": 100},
            {"id": "b", "predicted_tokens": 100, "actual_tokens": 101},
            {"id": "c", "predicted_tokens": 10, "actual_tokens": None}]
    assert [r["id"] for r in learning.select_predictor_rows(rows)] == ["a"]


def _log_requests(engine, n, t0, pred, actual):
    for i in range(n):
        record_request(engine, {"id": f"r{t0}-{i}", "created": t0, "instruction": "Echo.",
                                "user_input": "word " * (i + 1), "input_tokens": i + 3, "max_tokens": 256,
                                "predicted_tokens": pred, "actual_tokens": actual + i, "status": "done",
                                "finished": t0 + i * 0.01})


def test_retrain_predictor_incremental(settings):
    engine = get_db_engine(settings.database_url)
    t0 = time.time()
    _log_requests(engine, 30, t0, pred=5, actual=60)      # all badly predicted
    _log_requests(engine, 5, t0 + 1, pred=61, actual=60)  # well predicted: not added
    out = learning.retrain_predictor(settings, kind="linear", seed_limit_per_file=0)
    assert out["retrained"] and out["n_added"] == 30 and out["n_train"] == 30
    reg = Registry(settings.data_dir, "predictor")
    assert reg.active() == out["version"]
    meta = reg.meta(out["version"])
    assert meta["kind"] == "linear" and meta["metrics"]["n"] == 3 and meta["data"]["added"] == 30
    # nothing new since the last run: no new version
    again = learning.retrain_predictor(settings, kind="linear", seed_limit_per_file=0)
    assert not again["retrained"] and again["version"] == out["version"] and again["n_added"] == 0
    _log_requests(engine, 4, t0 + 5, pred=1, actual=200)  # fewer than learning_min_new_samples (32)
    few = learning.retrain_predictor(settings, kind="linear", seed_limit_per_file=0)
    assert not few["retrained"] and few["n_added"] == 4 and few["n_pending"] == 4
    _log_requests(engine, 4, t0 + 6, pred=1, actual=200)
    enough = settings.model_copy(update={"learning": settings.learning.model_copy(update={"min_new_samples": 8})})  # stored ones count: 4 + 4
    third = learning.retrain_predictor(enough, kind="linear", seed_limit_per_file=0)
    assert third["retrained"] and third["n_added"] == 4 and third["n_train"] == 38
    assert reg.versions() == sorted([out["version"], third["version"]])
    forced = learning.retrain_predictor(settings, force=True, kind="mean", seed_limit_per_file=0)
    assert forced["retrained"] and reg.meta(forced["version"])["kind"] == "mean"


def test_a_retrain_due_while_one_runs_is_skipped_not_queued(settings):
    with learning._lock(settings, "predictor"):
        with pytest.raises(learning.RetrainRunning):
            learning.retrain_predictor(settings, kind="linear", seed_limit_per_file=0)
    _log_requests(get_db_engine(settings.database_url), 3, time.time(), pred=5, actual=60)
    out = learning.retrain_predictor(settings, force=True, kind="mean", seed_limit_per_file=0)
    assert out["retrained"]  # the lock is free again once the first ends


def test_retrain_estimator_from_profile_and_log(settings):
    prof = learning.profile_samples_path(settings)
    prof.parent.mkdir(parents=True, exist_ok=True)
    samples = [{"size": b, "input_len": L, "gen_len": G, "seconds": 0.001 * b * (L + G) + 0.01 * G}
               for b in (1, 4, 16) for L in (16, 128) for G in (16, 128)]
    prof.write_text(json.dumps({"samples": samples}))
    out = learning.retrain_estimator(settings)
    assert out["retrained"] and out["n_train"] == len(samples) and out["n_added"] == 0
    engine = get_db_engine(settings.database_url)
    t = time.time()
    # a batch far slower than anything profiled (30 s): selected; a well-estimated one: not
    record_batch(engine, {"id": "b1", "created": t, "finished": t, "size": 16, "input_len": 128,
                          "actual_gen_len": 128, "batch_time_s": 30.0, "oom": False})
    record_batch(engine, {"id": "b2", "created": t, "finished": t + 0.1, "size": 1, "input_len": 16,
                          "actual_gen_len": 16, "batch_time_s": samples[0]["seconds"], "oom": False})
    out2 = learning.retrain_estimator(settings)
    assert out2["retrained"] and out2["n_added"] == 1 and out2["n_train"] == len(samples) + 1
    from predictor.estimator import load_estimator

    est = load_estimator(Registry(settings.data_dir, "estimator").active_path())
    assert est.estimate(16, 128, 128) > 10  # learned the slow batch (averaged with the profiled one)


def test_retrain_estimator_needs_samples(settings):
    out = learning.retrain_estimator(settings)
    assert not out["retrained"] and out["version"] is None


def test_training_rows_learn_the_served_model():
    """Logged lengths of another model are dropped; shared data is only the warm start, dropped
    once the served model has logged enough rows of its own."""
    from predictor.learning import training_rows

    shared = [{"source": "shared-train", "target": 10.0}] * 3
    mine = [{"source": f"log:{i}", "model": "m1", "target": 20.0} for i in range(4)]
    other = [{"source": "log:x", "model": "m2", "target": 99.0}]
    rows = training_rows(shared + mine + other, "m1", served_only_rows=5)
    assert rows == shared + mine  # warm start kept, the other model's rows never
    rows = training_rows(shared + mine + other + [{"source": "log:9", "model": "m1", "target": 1.0}], "m1",
                         served_only_rows=5)
    assert all(r["model"] == "m1" for r in rows) and len(rows) == 5
