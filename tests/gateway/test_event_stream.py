"""The SSE response sends its body from the request's own task and stops it when the client
leaves; a cancel that is not the client's still reaches the server, and a body that ends leaves
the task free of any cancel."""

from __future__ import annotations

import asyncio

import pytest

from gateway.sse import EventStream

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


def _run(body, receive):
    sent: list[dict] = []
    complete = asyncio.Event()

    async def send(message: dict) -> None:
        sent.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body"):
            complete.set()

    async def scenario():
        await EventStream(body(), media_type="text/event-stream")(SCOPE, lambda: receive(complete), send)
        for _ in range(3):  # a cancel left pending on the task, or a listener still about, would show here
            await asyncio.sleep(0.01)
        return asyncio.current_task().cancelling()

    return asyncio.run(scenario()), sent


def test_a_body_that_ends_is_sent_whole_and_leaves_no_cancel():
    async def body():
        for piece in ("data: a\n\n", "data: b\n\n"):
            yield piece
            await asyncio.sleep(0)

    async def receive(complete: asyncio.Event) -> dict:  # as uvicorn's: a disconnect once the answer is sent
        await complete.wait()
        return {"type": "http.disconnect"}

    cancelling, sent = _run(body, receive)
    assert [m.get("body") for m in sent[1:]] == [b"data: a\n\n", b"data: b\n\n", b""]
    assert sent[-1]["more_body"] is False and cancelling == 0


def test_the_client_leaving_stops_the_body_and_runs_its_cleanup():
    closed: list[str] = []

    async def body():
        try:
            yield "data: first\n\n"
            await asyncio.sleep(3600)  # waiting for a token that never comes
            yield "data: never\n\n"
        finally:
            closed.append("cleanup")

    async def receive(complete: asyncio.Event) -> dict:
        await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    cancelling, sent = _run(body, receive)
    assert closed == ["cleanup"] and cancelling == 0
    assert not any(m.get("body") == b"data: never\n\n" for m in sent)
    assert not any(m.get("more_body") is False for m in sent)  # no end: the client is gone


def test_a_cancel_that_is_not_the_clients_reaches_the_server():
    async def body():
        yield "data: first\n\n"
        await asyncio.sleep(3600)
        yield "data: never\n\n"

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        pass

    async def scenario():
        task = asyncio.create_task(EventStream(body())(SCOPE, receive, send))
        await asyncio.sleep(0.01)
        task.cancel()  # the server shutting down, say
        await task

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(scenario())
