"""The log DB keeps the bound a request was planned with (issue 20): the gateway writes it at
admission, an existing DB file gains the column without losing rows, and the online conformal
learner scores its misses against that logged bound, not against today's."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from cohort.logdb import (
    add_missing_columns,
    finish_request,
    finished_requests,
    get_db_engine,
    record_request,
    requests,
)
from cohort.settings import get_settings
from gateway.submit import Submission, admit
from launch.cli import app
from predictor.baselines import MeanPredictor
from predictor.conformal import GLOBAL, ConformalTable
from predictor.service import PredictorService
from tests.gateway.harness import gateway

# the requests table as it was before the planned bound was logged
OLD_SCHEMA = """CREATE TABLE requests (id VARCHAR(64) PRIMARY KEY, created FLOAT NOT NULL, model VARCHAR(256),
task VARCHAR(64), instruction TEXT, user_input TEXT, input_tokens INTEGER, max_tokens INTEGER,
predicted_tokens INTEGER, predictor_version VARCHAR(64), actual_tokens INTEGER, emulated_tokens INTEGER,
slo_s FLOAT, status VARCHAR(16) NOT NULL, error TEXT, batch_id VARCHAR(64), queued_s FLOAT, run_s FLOAT,
total_s FLOAT, finished FLOAT)"""


def test_existing_sqlite_file_gains_the_column_and_keeps_its_rows(tmp_path) -> None:
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute(OLD_SCHEMA)
        conn.execute("INSERT INTO requests (id, created, status, predicted_tokens, actual_tokens, finished) "
                     "VALUES ('old', 1.0, 'done', 10, 12, 5.0)")
    engine = get_db_engine(f"sqlite:///{path}")
    record_request(engine, {"id": "new", "predicted_tokens": 10, "predicted_upper": 31, "status": "queued"})
    finish_request(engine, "new", status="done", actual_tokens=40, finished=6.0)
    rows = {r["id"]: r for r in finished_requests(engine)}
    assert rows["old"]["predicted_upper"] is None and rows["old"]["actual_tokens"] == 12
    assert rows["new"]["predicted_upper"] == 31
    assert add_missing_columns(engine) == []  # a second opening (another process) adds nothing


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_existing_postgres_db_gains_the_column(request) -> None:
    """The same migration on a real PostgreSQL (skipped where none runs)."""
    from sqlalchemy import create_engine

    from tests.e2e.test_logdb_postgres import _pg_url

    url, drop = _pg_url()
    request.addfinalizer(drop)
    raw = create_engine(url)
    with raw.begin() as conn:
        conn.exec_driver_sql(OLD_SCHEMA)
        conn.exec_driver_sql("INSERT INTO requests (id, created, status) VALUES ('old', 1.0, 'queued')")
    raw.dispose()
    engine = get_db_engine(url)
    record_request(engine, {"id": "new", "predicted_tokens": 10, "predicted_upper": 31, "status": "queued"})
    with engine.connect() as conn:
        got = dict(conn.execute(select(requests.c.id, requests.c.predicted_upper)).all())
    assert got == {"old": None, "new": 31}
    assert add_missing_columns(engine) == []


def test_gateway_logs_the_bound_the_request_was_planned_with(tmp_path) -> None:
    async def scenario():
        async with gateway(tmp_path) as (app, _, _redis):
            ticket = await admit(app.state, Submission("", "hello", 7), "chat")
            return app, ticket.request

    app, req = asyncio.run(scenario())
    with app.state.db.connect() as conn:
        row = conn.execute(select(requests).where(requests.c.id == req.id)).one()
    assert req.predicted_upper is not None and row.predicted_upper == req.predicted_upper


@pytest.mark.parametrize("planned, sign", [(1, -1), (10_000, 1)])
def test_online_learner_scores_misses_against_the_logged_bound(settings, planned: int, sign: int) -> None:
    """Same completions, same model: rows logged with a bound they outgrew are misses (α falls, the
    bound widens), rows logged with a bound that covered them are not (α rises) — whatever bound
    the service would hand out now."""
    settings = settings.model_copy(update={"online": settings.online.model_copy(update={"interval_s": 3600.0})})
    model = MeanPredictor(40)
    model.conformal = ConformalTable(level=0.9, quantiles={GLOBAL: 0.5})
    svc = PredictorService(settings)
    svc._swap.current = (model, "v1")
    engine = get_db_engine(settings.database_url)
    for i in range(20):
        record_request(engine, {"id": f"r{i}", "model": "m", "instruction": "Say hi.", "user_input": "x",
                                "input_tokens": 3, "max_tokens": 2000, "predicted_tokens": 40,
                                "predicted_upper": planned, "predictor_version": "v1"})
        finish_request(engine, f"r{i}", status="done", actual_tokens=45, finished=100.0 + i)
    assert svc.sync_completions() == 20
    moved = [g.alpha - 0.1 for g in svc.online.groups.values()]  # α starts at 1 − level = 0.1
    assert moved and all(m * sign > 0 for m in moved), moved


def test_live_coverage_command_reads_the_logged_bounds(tmp_path, monkeypatch) -> None:
    """`cohort predictor coverage` counts only model-planned rows that carry their bound: 3 of the 4
    stayed within it; the cold-start row (planned at max_tokens) and a row from before the column
    existed are left out."""
    url = f"sqlite:///{tmp_path}/log.db"
    monkeypatch.setenv("COHORT_DATABASE_URL", url)
    get_settings.cache_clear()
    engine = get_db_engine(url)
    now = time.time()
    rows = [("a", 10, 20, 15, "v1"), ("b", 10, 20, 20, "v1"), ("c", 10, 20, 25, "v1"), ("d", 10, 30, 5, "v1"),
            ("cold", 64, 64, 70, None), ("old", 10, None, 99, "v1")]
    for i, (rid, point, upper, actual, version) in enumerate(rows):
        record_request(engine, {"id": rid, "model": "m", "max_tokens": 64, "predicted_tokens": point,
                                "predicted_upper": upper, "predictor_version": version})
        finish_request(engine, rid, status="done", actual_tokens=actual, finished=now - 10 + i)
    out = tmp_path / "cov.json"
    res = CliRunner().invoke(app, ["predictor", "coverage", "--json", str(out)])
    get_settings.cache_clear()
    assert res.exit_code == 0, res.output
    report = json.loads(out.read_text())
    assert report["all"]["n"] == 4 and report["all"]["q90_coverage"] == 0.75
    assert report["pools"]["m"]["upper_mean"] == 22.5
