"""One record per accepted request, settled once, saying what the client saw: the first owner
to settle a record wins (a worker finishing a row the gateway withdrew changes nothing), except
the gateway's withdrawal, which overrules (the client saw the 504 or left)."""

from __future__ import annotations

import asyncio

import pytest
from sqlalchemy import select

from cohort.logdb import finish_request, requests
from gateway.errors import APIError
from gateway.relay import Relay
from gateway.submit import Submission, admit
from tests.gateway.harness import end, gateway, leaves_after, next_request, publish


def _row(app, request_id: str):
    with app.state.db.connect() as conn:
        return conn.execute(select(requests).where(requests.c.id == request_id)).one()


def test_worker_done_after_the_timeout_changes_nothing(tmp_path):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.15) as (app, client, redis):
            r = await client.post("/v1/generate", json={"input": "slow", "max_tokens": 4})
            req = await next_request(redis)
            late = finish_request(app.state.db, req.id, status="done", actual_tokens=4)  # the worker, too late
            return app, r, req, late

    app, r, req, late = asyncio.run(scenario())
    row = _row(app, req.id)
    assert r.status_code == 504 and not late
    assert (row.status, row.actual_tokens) == ("timeout", None)


@pytest.mark.slow  # 0.26 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_timeout_overrules_a_done_written_as_the_deadline_passed(tmp_path):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.2) as (app, client, redis):
            task = asyncio.create_task(client.post("/v1/generate", json={"input": "racing", "max_tokens": 4}))
            req = await next_request(redis)
            finish_request(app.state.db, req.id, status="done", actual_tokens=4)  # recorded, not yet published
            return app, await task, req

    app, r, req = asyncio.run(scenario())
    assert r.status_code == 504 and _row(app, req.id).status == "timeout"


def test_answered_request_is_done_once(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            task = asyncio.create_task(client.post("/v1/generate", json={"input": "hi", "max_tokens": 4}))
            req = await next_request(redis)
            finish_request(app.state.db, req.id, status="done", actual_tokens=2)  # the worker records, then answers
            await publish(redis, req.id, end("ok!", 2))
            r = await task
            again = finish_request(app.state.db, req.id, status="failed", error="a re-run's failure")
            return app, r, req, again

    app, r, req, again = asyncio.run(scenario())
    assert r.status_code == 200 and not again
    row = _row(app, req.id)
    assert (row.status, row.error, row.actual_tokens) == ("done", None, 2)


@pytest.mark.slow  # 0.25 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_disconnect_is_final_and_the_worker_cannot_reopen(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, _, redis):
            ticket = await admit(app.state, Submission("", "hello", 4), "chat")
            with pytest.raises(APIError):
                await Relay(app.state, ticket, leaves_after(0.2)).collect()
            return app, ticket.request.id

    app, rid = asyncio.run(scenario())
    assert not finish_request(app.state.db, rid, status="done", actual_tokens=9)  # the row ran one more step
    assert _row(app, rid).status == "cancelled"
