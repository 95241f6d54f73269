"""Continuous execution on the real stack (gateway → Redis → batcher → Celery worker threads →
the engine loop on the built-in model) under a small KV pool: batches join the running rows
instead of waiting for them, every request gets exactly its tokens whatever was evicted and
resumed, a request too big even alone fails 507, and a worker killed with several groups running
loses nothing."""

from __future__ import annotations

import asyncio
import sqlite3
import time

import httpx
import pytest

from tests.e2e.scenarios import KV_BYTES_PER_TOKEN as DELTA

pytestmark = pytest.mark.e2e
STACK_ENV = {"COHORT_EXECUTION": "continuous", "COHORT_POLICY": "magnus", "COHORT_WMA_THRESHOLD": "1e12",
             "COHORT_KV_BUDGET_BYTES": str(1200 * DELTA), "COHORT_THETA_OVERRIDE_BYTES": "20000000",
             "COHORT_CONTINUOUS__STEP_TOKEN_BUDGET": "64"}


async def _post_all(url: str, bodies: list[dict], stagger_s: float = 0.0) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        tasks = []
        for b in bodies:
            tasks.append(asyncio.create_task(c.post("/v1/generate", json=b)))
            await asyncio.sleep(stagger_s)
        return await asyncio.gather(*tasks)


def test_batches_join_the_running_rows_and_every_answer_is_exact(stack):
    blocker = {"input": "a long answer that keeps the instance busy", "max_tokens": 800, "emulated_tokens": 800}
    bodies = [{"instruction": "Echo.", "input": f"item {i}", "max_tokens": 30 + 3 * i, "emulated_tokens": 30 + 3 * i}
              for i in range(16)]

    async def scenario():
        first = asyncio.create_task(_post_all(stack.url, [blocker]))
        await asyncio.sleep(1.0)
        rest = await _post_all(stack.url, bodies, stagger_s=0.05)
        return (await first)[0], rest, time.time()

    first, rest, _ = asyncio.run(scenario())
    assert first.status_code == 200 and first.json()["generated_tokens"] == 800
    assert [r.status_code for r in rest] == [200] * 16, [r.text for r in rest]
    assert [r.json()["generated_tokens"] for r in rest] == [30 + 3 * i for i in range(16)]
    con = sqlite3.connect(stack.db_path)
    # they ran beside the blocker instead of after it: most started (their group joined the
    # running rows) before it finished. Not "finished before it": on a starved machine the
    # gateway can be slow to hand them over, which says nothing about the engine.
    (blocker_end,) = con.execute("SELECT finished FROM requests WHERE emulated_tokens = 800").fetchone()
    starts = [s for (s,) in con.execute("SELECT finished - run_s FROM requests WHERE emulated_tokens < 800")]
    assert len(starts) == 16 and sum(s < blocker_end for s in starts) >= 8, (blocker_end, sorted(starts))
    assert con.execute("SELECT COUNT(*) FROM requests WHERE status = 'done'").fetchone()[0] == 17
    assert con.execute("SELECT COUNT(*) FROM batches WHERE oom = 1").fetchone()[0] == 0
    stats = stack.redis.hgetall("cohort:stats")
    assert int(stats.get("requests_failed", 0)) == 0 and int(stats.get("oom_splits", 0)) == 0


def test_streamed_answers_are_the_same_tokens_as_unstreamed_ones(stack):
    body = {"prompt": "continuous streaming check", "max_tokens": 40, "temperature": 0}
    plain = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", f"{stack.url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += httpx.Response(200, content=line[6:]).json()["choices"][0]["text"]
    assert text == plain


def test_request_that_cannot_fit_alone_fails_507(stack):
    r = httpx.post(f"{stack.url}/v1/generate", json={"input": "too long", "max_tokens": 1300,
                                                      "emulated_tokens": 1300}, timeout=120)
    assert r.status_code == 507, r.text


def test_worker_killed_with_several_groups_running_loses_nothing(stack):
    # Two groups must run at once when the worker dies. By construction: a 500-token blocker is
    # seen running before the 200-token jobs are sent, so they join beside it (on a fast CPU four
    # jobs sent one after another could each finish before the next joined: the kill then found
    # nothing to requeue).
    blocker = {"input": "long job blocker", "max_tokens": 500, "emulated_tokens": 500}
    bodies = [{"input": f"long job {i}", "max_tokens": 200, "emulated_tokens": 200} for i in range(3)]

    async def running_groups(at_least: int) -> None:
        deadline = time.time() + 60
        while time.time() < deadline:
            running = [k for k in stack.redis.scan_iter("cohort:batch:*:admitted")
                       if not stack.redis.exists(k.replace(":admitted", ":done"))]
            if len(running) >= at_least:
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"fewer than {at_least} groups ran at once within 60 s")

    async def scenario() -> list[httpx.Response]:
        first = asyncio.create_task(_post_all(stack.url, [blocker]))
        await running_groups(1)
        rest = asyncio.create_task(_post_all(stack.url, bodies, stagger_s=0.05))
        await running_groups(2)
        stack.kill("worker")
        stack.spawn("worker2", "worker")
        return (await first) + (await rest)

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * 4, [r.text for r in responses]
    assert [r.json()["generated_tokens"] for r in responses] == [500, 200, 200, 200]
    assert int(stack.redis.hget("cohort:stats", "requeues") or 0) >= 2
