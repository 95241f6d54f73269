"""The papers' mode (static execution, split recovery): a batch that outgrows the instance's KV
memory is split in two and both halves re-run; a single request that cannot fit fails with a
clear error (never loops). tests/e2e/test_preemption.py runs the same scenario elastically."""

from __future__ import annotations

import sqlite3

import httpx
import pytest

from tests.e2e.scenarios import KV_BYTES_PER_TOKEN, behind_a_blocker

pytestmark = pytest.mark.e2e
DELTA = KV_BYTES_PER_TOKEN
# The instance advertises 20 MB but only 600 tokens of KV really fit: predicted lengths say a
# batch fits, the real run outgrows memory — the situation OOM recovery exists for.
STACK_ENV = {"COHORT_POLICY": "magnus", "COHORT_WMA_THRESHOLD": "1e12", "COHORT_EXECUTION": "static",
             "COHORT_OOM_RECOVERY": "split",
             "COHORT_KV_BUDGET_BYTES": str(600 * DELTA), "COHORT_THETA_OVERRIDE_BYTES": "20000000"}


def test_oom_batch_is_split_and_every_request_answered(stack):
    """A blocker keeps the only instance busy while 16 requests arrive; they form one batch whose
    real KV need (16 · ~62 tokens) outgrows the 600-token budget mid-run."""
    blocker = {"input": "hold the instance", "max_tokens": 300, "emulated_tokens": 300}
    bodies = [{"instruction": "Echo.", "input": f"item {i}", "max_tokens": 50, "emulated_tokens": 50}
              for i in range(16)]

    first, responses = behind_a_blocker(stack, blocker, bodies)
    assert first.status_code == 200 and first.json()["generated_tokens"] == 300
    assert [r.status_code for r in responses] == [200] * 16, [r.text for r in responses]
    assert all(r.json()["generated_tokens"] == 50 for r in responses)
    assert max(r.json()["batch"]["size"] for r in responses) < 16  # answered by the split halves
    assert int(stack.redis.hget("cohort:stats", "oom_splits") or 0) >= 1
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT COUNT(*) FROM batches WHERE oom = 1").fetchone()[0] >= 1
    assert con.execute("SELECT COUNT(*) FROM requests WHERE status = 'done'").fetchone()[0] == 17


def test_single_request_that_cannot_fit_fails_clearly(stack):
    r = httpx.post(f"{stack.url}/v1/generate", json={"input": "too long", "max_tokens": 700,
                                                      "emulated_tokens": 700}, timeout=120)
    assert r.status_code == 507, r.text
    err = r.json()["error"]
    assert err["code"] == "out_of_memory" and "KV memory" in err["message"]
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT COUNT(*) FROM requests WHERE status = 'failed'").fetchone()[0] == 1
