"""The retention pass: log DB rows and prompts, model versions, training stores, cache."""

from __future__ import annotations

import json
import time

import pytest

from cohort import logdb
from cohort.logdb import batches, get_db_engine, log_counts, record_batch, record_requests
from cohort.settings import Settings
from learning.retention import prune_cache, prune_versions, retention_pass
from predictor.learning import predictor_store
from predictor.registry import Registry
from predictor.train_store import append_bounded, read_rows


def _settings(tmp_path, **kw) -> Settings:
    return Settings(data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path / 'log.db'}", **kw)


def _fill_log(s: Settings, now: float, n: int) -> None:
    engine = get_db_engine(s.database_url)
    rows = [{"id": f"r{i}", "created": now - 10_000 + i, "instruction": "say", "user_input": f"prompt {i}",
             "status": "done", "actual_tokens": 5, "finished": now - 10_000 + i} for i in range(n)]
    rows.append({"id": "open", "created": now - 20_000, "instruction": "wait", "user_input": "x", "status": "queued",
                 "actual_tokens": None, "finished": None})
    record_requests(engine, rows)
    for i in range(n):
        record_batch(engine, {"id": f"b{i}", "created": now - 10_000 + i, "finished": now - 10_000 + i, "size": 1})


@pytest.mark.parametrize("chunk", [2000, 7])  # one transaction, or many short ones
@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_log_rows_are_bounded_prompts_dropped_measurements_kept_open_rows_untouched(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(logdb, "PRUNE_CHUNK", chunk)
    s = _settings(tmp_path, retention={"log_max_rows": 100, "prompt_age_s": 10_000 - 150,
                                        "log_max_age_s": 10_000 - 280})
    now = time.time()
    _fill_log(s, now, 300)
    out = retention_pass(s, now=now)
    engine = get_db_engine(s.database_url)
    counts = log_counts(engine)
    # 20 rows are younger than the age limit; the open (queued) row is never deleted
    assert counts["requests"] == 21 and counts["batches"] == 20
    assert out["log"]["requests_aged"] == 280
    with engine.connect() as conn:
        left = {r.id: r for r in conn.execute(batches.select())}
    assert set(left) == {f"b{i}" for i in range(280, 300)}
    s2 = _settings(tmp_path / "two", retention={"log_max_rows": 100, "prompt_age_s": 10_000 - 250})
    _fill_log(s2, now, 300)
    retention_pass(s2, now=now)
    counts = log_counts(get_db_engine(s2.database_url))
    assert counts["requests"] == 101 and counts["batches"] == 100  # the newest 100 + the open one
    assert counts["prompts"] == 50 + 1  # prompts of rows settled > 9750 s ago blanked; measurements stay


def test_versions_keep_the_newest_n_and_the_active_one(tmp_path):
    reg = Registry(tmp_path, "predictor")
    made = []
    for _ in range(6):
        v, staging = reg.new_dir()
        (staging / "meta.json").write_text(json.dumps({"kind": "mean"}))
        reg.commit(v, staging, activate=False)
        made.append(v)
    reg.activate(made[0])  # a rollback to the oldest
    deleted = prune_versions(reg, keep=2)
    assert deleted == made[1:4]
    assert reg.versions() == [made[0], *made[4:]] and reg.active() == made[0]


def test_pass_compacts_stores_and_cache(tmp_path):
    s = _settings(tmp_path, learning={"store_recent_rows": 10, "store_reservoir_rows": 5},
                  retention={"cache_mb": 1})
    append_bounded(predictor_store(s), [{"i": i} for i in range(100)], recent=1000, reservoir=0)
    cache = s.data_dir / "cache" / "emb" / "enc"
    cache.mkdir(parents=True)
    for i in range(4):
        (cache / f"s{i}.npz").write_bytes(b"x" * 400_000)
    out = retention_pass(s)
    assert out["store_rows"]["predictor"] == 15 and len(read_rows(predictor_store(s))) == 15
    assert out["cache_shards_deleted"] == 2 and prune_cache(cache, 1 << 20) == 0
