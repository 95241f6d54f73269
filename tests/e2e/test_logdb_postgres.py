"""The log DB on a real PostgreSQL (by URL): the SQLite tests of tests/test_logdb.py, run again
on a fresh database of the local server (skipped where none runs), dropped afterwards."""

from __future__ import annotations

import os
import uuid

import pytest
from sqlalchemy import create_engine, text

from cohort.logdb import get_db_engine
from tests.test_logdb import (  # noqa: F401 - collected here again, with this module's ``db``
    test_batch_records_are_idempotent_upserts,
    test_request_lifecycle_and_learning_queries,
    test_settling_many_records_at_once_keeps_each_ones_values_and_the_first_owner_rule,
    test_stale_queued_rows_are_failed_and_nothing_else,
)

pytestmark = pytest.mark.e2e

PG_ADMIN = os.environ.get("COHORT_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


def _pg_url():
    """A fresh database on the local PostgreSQL, dropped afterwards; skipped where none runs."""
    try:
        admin = create_engine(PG_ADMIN, isolation_level="AUTOCOMMIT", connect_args={"connect_timeout": 2})
        name = f"cohort_test_{uuid.uuid4().hex[:8]}"
        with admin.connect() as c:
            c.execute(text(f"CREATE DATABASE {name}"))
    except Exception as e:  # no server here: the embedded path is still tested
        pytest.skip(f"PostgreSQL not reachable at {PG_ADMIN}: {e}")
    url = PG_ADMIN.rsplit("/", 1)[0] + f"/{name}"

    def drop():
        get_db_engine(url).dispose()
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE IF EXISTS {name}"))
        admin.dispose()
    return url, drop


@pytest.fixture
def db():
    url, drop = _pg_url()
    yield get_db_engine(url)
    drop()
