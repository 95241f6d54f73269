"""The log DB on SQLite (the embedded default); the same tests run on PostgreSQL in tests/e2e."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import inspect as sa_inspect
from sqlalchemy import select

from cohort.logdb import (
    fail_stale_queued,
    finish_request,
    finish_requests,
    finished_batches,
    finished_requests,
    get_db_engine,
    record_batch,
    record_request,
    requests,
)


@pytest.fixture
def db(tmp_path):
    """The embedded default; tests/e2e/test_logdb_postgres.py runs these same tests on PostgreSQL."""
    return get_db_engine(f"sqlite:///{tmp_path}/log.db")


def test_request_lifecycle_and_learning_queries(db):
    record_request(db, {"id": "r1", "created": 100.0, "input_tokens": 12, "max_tokens": 64,
                        "predicted_tokens": 40, "status": "queued", "instruction": "i", "user_input": "u"})
    record_request(db, {"id": "r2", "created": 101.0, "input_tokens": 5, "max_tokens": 64,
                        "predicted_tokens": 9, "status": "queued"})
    assert finished_requests(db) == []
    finish_request(db, "r1", status="done", actual_tokens=33, batch_id="b1", finished=110.0)
    finish_request(db, "r2", status="failed", error="out of memory", finished=111.0)
    done = finished_requests(db)
    assert [r["id"] for r in done] == ["r1"] and done[0]["actual_tokens"] == 33
    assert finished_requests(db, since=110.0) == []


def test_settling_many_records_at_once_keeps_each_ones_values_and_the_first_owner_rule(db):
    for i in range(5):
        record_request(db, {"id": f"r{i}", "created": 100.0 + i, "input_tokens": 4, "max_tokens": 64,
                            "predicted_tokens": 8, "status": "queued"})
    finish_request(db, "r4", status="cancelled", finished=105.0)  # settled first: stays as it is
    changed = finish_requests(db, [
        ("r0", {"status": "done", "actual_tokens": 10, "batch_id": "b1"}),
        ("r1", {"status": "done", "actual_tokens": 11, "batch_id": "b1"}),   # same columns: one statement
        ("r2", {"status": "failed", "error": "boom"}),                       # other columns
        ("r3", {"status": "done", "actual_tokens": 13, "batch_id": "b2"}),
        ("r4", {"status": "done", "actual_tokens": 14, "batch_id": "b2"}),
    ])
    assert changed == 4
    with db.connect() as c:
        rows = {r.id: r for r in c.execute(select(requests))}
    assert [(rows[f"r{i}"].status, rows[f"r{i}"].actual_tokens) for i in range(5)] == [
        ("done", 10), ("done", 11), ("failed", None), ("done", 13), ("cancelled", None)]
    assert rows["r2"].error == "boom" and rows["r1"].batch_id == "b1" and rows["r4"].finished == 105.0
    assert all(rows[f"r{i}"].finished is not None for i in range(4))
    assert finish_requests(db, [("r4", {"status": "timeout"})], overrule=True) == 1


def test_batch_records_are_idempotent_upserts(db):
    row = {"id": "b1", "created": 1.0, "started": 2.0, "finished": 3.0, "size": 4, "input_len": 10,
           "predicted_gen_len": 20, "actual_gen_len": 22, "batch_time_s": 1.0, "oom": False}
    record_batch(db, row)
    record_batch(db, {**row, "batch_time_s": 1.5})  # a redelivered batch writes once
    record_batch(db, {**row, "id": "b2", "oom": True})
    got = finished_batches(db)
    assert [b["id"] for b in got] == ["b1"] and got[0]["batch_time_s"] == 1.5
    assert {b["id"] for b in finished_batches(db, include_oom=True)} == {"b1", "b2"}


def test_stale_queued_rows_are_failed_and_nothing_else(db):
    t = time.time()
    for rid, created, status in (("old", t - 1000, "queued"), ("new", t, "queued"), ("done", t - 1000, "done")):
        record_request(db, {"id": rid, "created": created, "instruction": "", "user_input": "x", "input_tokens": 1,
                            "max_tokens": 4, "predicted_tokens": 4, "status": status})
    assert fail_stale_queued(db, t - 500, "lost") == 1
    with db.connect() as conn:
        rows = dict(conn.execute(select(requests.c.id, requests.c.status)).all())
    assert rows == {"old": "failed", "new": "queued", "done": "done"}


def test_tables_created_by_another_process_meanwhile_are_not_an_error(tmp_path, monkeypatch):
    """Two processes opening a new DB at once: both find a table missing, the second's CREATE fails
    ("table ... already exists"); the loser tries again and finds it."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    from cohort import logdb

    engine = create_engine(f"sqlite:///{tmp_path / 'race.db'}")
    real = logdb.metadata.create_all
    calls = []

    def racing(bind, tables=None, checkfirst=True):
        calls.append(1)
        if len(calls) == 1:  # the other process created them between our look and our CREATE
            real(create_engine(f"sqlite:///{tmp_path / 'race.db'}"), tables=tables)
            raise OperationalError("CREATE TABLE requests", {}, Exception("table requests already exists"))
        return real(bind, tables=tables, checkfirst=checkfirst)

    monkeypatch.setattr(logdb.metadata, "create_all", racing)
    monkeypatch.setattr(logdb.time, "sleep", lambda s: None)
    logdb.create_tables(engine)
    assert len(calls) == 2
    assert "requests" in sa_inspect(engine).get_table_names()


def test_a_table_that_cannot_be_created_still_fails_after_the_retries(tmp_path, monkeypatch):
    from sqlalchemy import create_engine
    from sqlalchemy.exc import OperationalError

    from cohort import logdb

    def broken(bind, tables=None, checkfirst=True):
        raise OperationalError("CREATE TABLE requests", {}, Exception("disk I/O error"))

    monkeypatch.setattr(logdb.metadata, "create_all", broken)
    monkeypatch.setattr(logdb.time, "sleep", lambda s: None)
    with pytest.raises(OperationalError):
        logdb.create_tables(create_engine(f"sqlite:///{tmp_path / 'broken.db'}"))
