"""Elastic execution with preemption (the default) on the scenario of test_oom_recovery: the
batch that outgrows memory hands rows back as continuations that keep their tokens; every
request gets exactly its tokens, nothing restarts, and a request too big even alone fails 507."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from tests.e2e.scenarios import KV_BYTES_PER_TOKEN as DELTA
from tests.e2e.scenarios import behind_a_blocker

pytestmark = pytest.mark.e2e
STACK_ENV = {"COHORT_POLICY": "magnus", "COHORT_WMA_THRESHOLD": "1e12", "COHORT_EXECUTION": "elastic",
             "COHORT_OOM_RECOVERY": "preempt",
             "COHORT_KV_BUDGET_BYTES": str(600 * DELTA), "COHORT_THETA_OVERRIDE_BYTES": "20000000"}


def test_overflowing_batch_preempts_rows_and_keeps_their_tokens(stack):
    blocker = {"input": "hold the instance", "max_tokens": 300, "emulated_tokens": 300}
    bodies = [{"instruction": "Echo.", "input": f"item {i}", "max_tokens": 50 + i, "emulated_tokens": 50 + i}
              for i in range(16)]

    first, responses = behind_a_blocker(stack, blocker, bodies)
    assert first.status_code == 200 and first.json()["generated_tokens"] == 300
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses]
    assert [r.json()["generated_tokens"] for r in responses] == [50 + i for i in range(16)]
    stats = stack.redis.hgetall("cohort:stats")
    assert int(stats.get("preemptions", 0)) >= 1 and int(stats.get("oom_splits", 0)) == 0
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT COUNT(*) FROM batches WHERE oom = 1").fetchone()[0] == 0
    assert con.execute("SELECT COUNT(*) FROM requests WHERE status = 'done'").fetchone()[0] == 17


def test_request_that_cannot_fit_alone_fails_507(stack):
    r = httpx.post(f"{stack.url}/v1/generate", json={"input": "too long", "max_tokens": 700,
                                                      "emulated_tokens": 700}, timeout=120)
    assert r.status_code == 507, r.text
    assert r.json()["error"]["code"] == "out_of_memory"
