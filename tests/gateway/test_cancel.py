"""A client that goes away, or a request past the gateway's timeout, is withdrawn: cancel key
(with its TTL) and CANCELS in Redis, its status in the log DB, a count in metrics."""

from __future__ import annotations

import asyncio
import time

import pytest
from sqlalchemy import select

from cohort import bus
from cohort.logdb import requests
from cohort.protocol import StreamEvent
from gateway.errors import APIError
from gateway.relay import Relay
from gateway.sse import Chunks, sse_events, sse_response
from gateway.submit import Submission, admit
from tests.gateway.harness import gateway, leaves_after, next_request, publish, worker


def _status(app, request_id: str) -> tuple[str, str | None]:
    with app.state.db.connect() as conn:
        row = conn.execute(select(requests.c.status, requests.c.error).where(requests.c.id == request_id)).one()
    return row.status, row.error


async def _withdrawn(redis, request_id: str) -> tuple[bool, int, list[str]]:
    key = bus.cancel_key(request_id)
    return bool(await redis.exists(key)), await redis.ttl(key), await redis.lrange(bus.pool_keys("default").cancels, 0, -1)


def _cancelled_count(app, endpoint: str, reason: str) -> float:
    return app.state.metrics.cancelled.labels(endpoint, reason)._value.get()


@pytest.mark.slow  # 0.25 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_timeout_withdraws_and_answers_504(tmp_path):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.2) as (app, client, redis):
            t0 = time.monotonic()
            r = await client.post("/v1/generate", json={"input": "never answered", "max_tokens": 4})
            waited = time.monotonic() - t0
            req = await next_request(redis)
            return app, r, waited, req, await _withdrawn(redis, req.id)

    app, r, waited, req, (exists, ttl, cancels) = asyncio.run(scenario())
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout"
    assert waited >= 0.2  # (admission loads the tokenizer first: no tight upper bound)
    assert exists and 0 < ttl <= bus.CANCEL_TTL_S and cancels == [req.id]
    assert _status(app, req.id)[0] == "timeout"
    assert _cancelled_count(app, "generate", "timeout") == 1


@pytest.mark.slow  # 0.26 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_disconnect_while_waiting_withdraws(tmp_path):
    """Non-streaming: the disconnect check between read slices notices the client left."""
    async def scenario():
        async with gateway(tmp_path) as (app, _, redis):
            ticket = await admit(app.state, Submission("", "hello", 4), "chat")
            with pytest.raises(APIError) as e:
                await Relay(app.state, ticket, leaves_after(0.2)).collect()
            return app, ticket, e.value, await _withdrawn(redis, ticket.request.id)

    app, ticket, err, (exists, _, cancels) = asyncio.run(scenario())
    assert err.status == 499 and err.code == "cancelled"
    assert exists and cancels == [ticket.request.id]
    assert _status(app, ticket.request.id) == ("cancelled", "the client disconnected")
    assert _cancelled_count(app, "chat", "disconnect") == 1


def test_stream_cancelled_on_disconnect_withdraws(tmp_path):
    """Streaming: the response is cancelled when the ASGI server reports http.disconnect; the
    request is withdrawn although the task that would do it was cancelled."""
    async def scenario():
        async with gateway(tmp_path) as (app, _, redis):
            ticket = await admit(app.state, Submission("", "hello", 8), "chat")
            relay = Relay(app.state, ticket)
            sent: list[dict] = []
            first_delta = asyncio.Event()

            async def send(message: dict) -> None:
                sent.append(message)
                if b'"content":"tok"' in message.get("body", b""):
                    first_delta.set()

            async def receive() -> dict:
                await first_delta.wait()
                return {"type": "http.disconnect"}

            await publish(redis, ticket.request.id, StreamEvent.delta("tok", 1))
            response = sse_response(relay, Chunks("chat", "c", 0, "m"))
            scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
            await asyncio.wait_for(response(scope, receive, send), 10)
            return app, ticket, sent, await _withdrawn(redis, ticket.request.id)

    app, ticket, sent, (exists, _, cancels) = asyncio.run(scenario())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
    assert exists and cancels == [ticket.request.id]
    assert _status(app, ticket.request.id)[0] == "cancelled"
    assert _cancelled_count(app, "chat", "disconnect") == 1


def test_stream_closed_after_the_opening_chunk_withdraws(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, _, redis):
            ticket = await admit(app.state, Submission("", "hello", 8), "chat")
            body = sse_events(Relay(app.state, ticket), Chunks("chat", "c", 0, "m"))
            opening = await anext(body)  # sent before any token exists
            await body.aclose()
            return app, ticket, opening, await _withdrawn(redis, ticket.request.id)

    app, ticket, opening, (exists, _, cancels) = asyncio.run(scenario())
    assert '"role":"assistant"' in opening
    assert exists and cancels == [ticket.request.id]
    assert _status(app, ticket.request.id)[0] == "cancelled"


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_answered_request_is_not_withdrawn(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            w = asyncio.create_task(worker(redis, ["ok"]))
            r = await client.post("/v1/generate", json={"input": "hi", "max_tokens": 2})
            req = await w
            return app, r, await _withdrawn(redis, req.id)

    app, r, (exists, _, cancels) = asyncio.run(scenario())
    assert r.status_code == 200 and not exists and cancels == []
    assert _cancelled_count(app, "generate", "disconnect") == 0
