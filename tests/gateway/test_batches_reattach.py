"""A job row sent again re-attaches to its request still in the system (gateway.reattach), on the
real gateway app (fakeredis, a fake worker): one request runs, both sends get its answer; only
the runner may name a request id; a runner restart keeps the row's attempt (so its id)."""

from __future__ import annotations

import asyncio
import json

import pytest
from sqlalchemy import func, select

from cohort import bus, jobdb
from cohort.apikeys import ROW_REQUEST_HEADER, RUNNER_HEADER, row_request_id, runner_secret
from cohort.logdb import requests
from tests.gateway.harness import answering, gateway

BODY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
RID = row_request_id("batch-abc:7", 1)


async def _queued(redis, n: int, task: asyncio.Task) -> None:
    for _ in range(1500):
        if await redis.llen(bus.pool_keys("default").incoming) >= n:
            return
        if task.done():
            raise AssertionError(f"answered before it was queued: {task.result().text}")
        await asyncio.sleep(0.02)
    raise TimeoutError("the request was not queued")


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_row_sent_again_follows_the_request_already_running(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            h = {"authorization": f"Bearer {runner_secret(app.state.settings.data_dir)}", RUNNER_HEADER: "",
                 ROW_REQUEST_HEADER: RID}
            first = asyncio.create_task(client.post("/v1/chat/completions", json=BODY, headers=h))
            await _queued(redis, 1, first)
            again = asyncio.create_task(client.post("/v1/chat/completions", json=BODY, headers=h))
            await asyncio.sleep(0.5)
            queued = await redis.llen(bus.pool_keys("default").incoming)
            async with answering(redis):
                a, b = await asyncio.gather(first, again)
            with app.state.db.connect() as conn:
                records = conn.execute(select(func.count()).select_from(requests)).scalar()
            return a, b, queued, records

    a, b, queued, records = asyncio.run(scenario())
    assert queued == 1 and records == 1  # the second send admitted nothing
    assert a.status_code == b.status_code == 200
    assert a.json()["id"] == b.json()["id"] == f"chatcmpl-{RID}"
    assert a.json()["choices"][0]["message"]["content"] == b.json()["choices"][0]["message"]["content"] == "ok"


def test_only_the_runner_names_a_request_id(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_app, client, redis), answering(redis):
            return await client.post("/v1/chat/completions", json=BODY, headers={ROW_REQUEST_HEADER: RID})

    r = asyncio.run(scenario())
    assert r.status_code == 200 and r.json()["id"] != f"chatcmpl-{RID}"


def test_a_runner_restart_keeps_the_rows_attempt(tmp_path):
    db = jobdb.jobs_engine(f"sqlite:///{tmp_path / 'c.db'}")
    jobdb.insert_rows(db, "batch-abc", [{"idx": i, "custom_id": f"c{i}", "body": BODY} for i in range(3)])
    claimed = jobdb.claim_rows(db, "batch-abc", 2)
    assert [r["attempts"] for r in claimed] == [1, 1]
    assert jobdb.release_all_running(db) == 2
    again = jobdb.claim_rows(db, "batch-abc", 3)
    # the same request ids: a restarted runner's rows re-attach to their requests
    assert [row_request_id(r["id"], r["attempts"]) for r in again[:2]] == [
        row_request_id(r["id"], r["attempts"]) for r in claimed]
    assert json.loads(again[2]["body"]) == BODY


def test_a_row_whose_request_failed_runs_again_under_an_id_named_by_the_row(tmp_path):
    from cohort.logdb import record_request

    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            record_request(app.state.db, {"id": RID, "created": 0.0, "status": "failed"})
            h = {"authorization": f"Bearer {runner_secret(app.state.settings.data_dir)}", RUNNER_HEADER: "",
                 ROW_REQUEST_HEADER: RID}
            async with answering(redis):
                return await client.post("/v1/chat/completions", json=BODY, headers=h)

    r = asyncio.run(scenario())
    assert r.status_code == 200 and r.json()["id"].startswith(f"chatcmpl-{RID}-")
