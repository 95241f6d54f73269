"""The engine-stream client against scripted servers on loopback: pieces handed over as they arrive
on one reused connection, the key sent, refusals and failures told apart, a stream its caller ends
or leaves closed (so vLLM aborts it), silence past the read timeout, a connection the server
closed while idle sent again, and a raw server's close-delimited and CRLF-framed answers."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from tests.loopback import open_sse, serving
from upstream.chunks import Chunk, UpstreamDown, UpstreamRefused
from upstream.sse_client import SSEClient

PEERS = web.AppKey("peers", list)
CLOSED = web.AppKey("closed", list)


def _event(i: int, finish: str | None = None) -> bytes:
    return f"data: {json.dumps({'choices': [{'text': chr(97 + i), 'token_ids': [i], 'finish_reason': finish}]})}\n\n".encode()


def _engine(n: int = 3, *, status: int = 200, silent_after: int | None = None, error_after: int | None = None,
            cut_after: int | None = None, key: str | None = None, delay_s: float = 0.002) -> web.Application:
    """Streams ``n`` pieces (the last "length"), then [DONE]; ``peers`` lists each request's client
    port (one port: one reused connection), ``closed`` the requests whose client closed early."""
    peers: list[int] = []
    closed: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername")[1])
        me = len(peers)
        await request.json()
        r = await open_sse(request, key=key, status=status, message="no room")
        if r.status != 200:
            return r
        try:
            for i in range(n):
                if i == silent_after:
                    await asyncio.sleep(1)
                if i == cut_after:
                    request.transport.close()
                    return r
                if i == error_after:
                    await r.write(b'data: {"error": {"message": "engine fault"}}\n\n')
                    return r
                await asyncio.sleep(delay_s)
                await r.write(_event(i, "length" if i == n - 1 else None))
            await r.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError):
            closed.append(me)
            raise
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app[PEERS], app[CLOSED] = peers, closed
    return app


async def _collect(client: SSEClient, url: str, stop_at: int | None = None) -> list[Chunk]:
    got: list[Chunk] = []

    def take(ch: Chunk) -> bool:
        got.append(ch)
        return stop_at is not None and len(got) >= stop_at

    await client.stream(f"{url}/completions", {"prompt": [1], "max_tokens": 9, "stream": True}, take)
    return got


def test_pieces_arrive_in_order_on_one_reused_connection_with_the_key():
    async def go():
        app = _engine(3, key="k1")
        async with serving(app) as url:
            client = SSEClient(headers={"authorization": "Bearer k1"})
            first = await _collect(client, url)
            second = await _collect(client, url)
            await client.aclose()
        return first, second, app[PEERS]

    first, second, peers = asyncio.run(go())
    assert [c.text for c in first] == ["a", "b", "c"] and [c.ids for c in second] == [[0], [1], [2]]
    assert first[-1].finish == "length" and len(peers) == 2 and peers[0] == peers[1]


@pytest.mark.parametrize(("status", "kind"), [(400, UpstreamRefused), (401, UpstreamRefused), (429, UpstreamDown),
                                              (500, UpstreamDown)])
def test_a_refusal_and_a_failure_are_told_apart_with_the_servers_words(status, kind):
    async def go():
        async with serving(_engine(status=status)) as url:
            client = SSEClient()
            try:
                await _collect(client, url)
            finally:
                await client.aclose()

    with pytest.raises(kind, match=f"{status}: .*no room"):
        asyncio.run(go())


@pytest.mark.parametrize(("fault", "words"), [
    ({"cut_after": 1}, "broke"), ({"error_after": 1}, "engine fault"),
    pytest.param({"silent_after": 1}, "no byte for 0.3 s", marks=pytest.mark.slow),  # a second of the server's sleep
])
def test_a_stream_that_breaks_errs_or_goes_silent_is_down(fault, words):
    async def go():
        async with serving(_engine(3, **fault)) as url:
            client = SSEClient(read_timeout_s=0.3)
            try:
                await _collect(client, url)
            finally:
                await client.aclose()

    with pytest.raises(UpstreamDown, match=words):
        asyncio.run(go())


def test_a_caller_that_ends_or_leaves_closes_the_connection():
    async def go():
        app = _engine(40, delay_s=0.01)
        async with serving(app) as url:
            client = SSEClient()
            ended = await _collect(client, url, stop_at=2)  # a stop string found
            task = asyncio.ensure_future(_collect(client, url))
            await asyncio.sleep(0.1)
            task.cancel()  # the client left
            await asyncio.gather(task, return_exceptions=True)
            it = client.chunks(f"{url}/completions", {"prompt": [1], "stream": True})
            assert (await anext(it)).text == "a"
            await it.aclose()  # the worker's relayed row, cancelled
            await asyncio.sleep(0.2)
            await client.aclose()
        return ended, app[PEERS], app[CLOSED]

    ended, peers, closed = asyncio.run(go())
    assert len(ended) == 2 and sorted(closed) == [1, 2, 3] and len(set(peers)) == 3  # none went back to the pool


def test_a_connection_the_server_closed_while_idle_is_not_a_failure():
    async def go():
        app = _engine(2)
        async with serving(app) as url:
            client = SSEClient()
            await _collect(client, url)
            for idle in client._idle.values():  # the server's keep-alive ran out: it closed its end
                for conn in idle:
                    conn.transport.get_extra_info("socket").shutdown(1)
            await asyncio.sleep(0.05)
            again = await _collect(client, url)
            await client.aclose()
        return again, app[PEERS]

    again, peers = asyncio.run(go())
    assert [c.text for c in again] == ["a", "b"] and len(peers) == 2


def _raw_server(answer: bytes):
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(answer)
        await writer.drain()
        writer.close()
    return asyncio.start_server(handle, "127.0.0.1", 0)


@pytest.mark.parametrize("answer", [
    b"HTTP/1.0 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + _event(0) + _event(1, "stop"),  # no [DONE]
    b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    + (_event(0) + _event(1, "stop") + b"data: [DONE]\n\n").replace(b"\n", b"\r\n"),
])
def test_a_close_delimited_answer_and_crlf_lines_are_read_whole(answer):
    async def go():
        server = await _raw_server(answer)
        port = server.sockets[0].getsockname()[1]
        client = SSEClient()
        try:
            return await _collect(client, f"http://127.0.0.1:{port}/v1")
        finally:
            await client.aclose()
            server.close()

    got = asyncio.run(go())
    assert [c.text for c in got] == ["a", "b"] and got[-1].finish == "stop"


def test_a_server_that_is_not_there_is_down():
    async def go():
        client = SSEClient(connect_timeout_s=2)
        await _collect(client, "http://127.0.0.1:9/v1")

    with pytest.raises(UpstreamDown, match="cannot connect"):
        asyncio.run(go())
