"""The entry points refuse a misspelt policy at start-up, and start the gateway's uvicorn with
the limits the settings give."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import typer
import uvicorn

from cohort.settings import Settings, get_settings
from launch.bounded_http import BoundedHttpTools
from launch.cli import checked_settings, gateway_server_options
from procstack.stack import free_port


def test_an_unknown_policy_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("COHORT_POLICY", "magnuss")
    get_settings.cache_clear()
    try:
        with pytest.raises(typer.BadParameter, match="magnuss"):
            checked_settings()
        monkeypatch.setenv("COHORT_POLICY", "s3-hrrn")
        get_settings.cache_clear()
        assert checked_settings().policy == "s3-hrrn"
    finally:
        get_settings.cache_clear()


def test_gateway_server_options_carry_the_settings():
    s = Settings(_env_file=None, http_max_header_bytes=4096, http_limit_concurrency=7, http_keep_alive_s=3,
                 http_access_log=False)
    opts = gateway_server_options(s)
    assert opts["http"].max_head_bytes == 4096 and issubclass(opts["http"], BoundedHttpTools)
    assert {k: v for k, v in opts.items() if k != "http"} == {"limit_concurrency": 7, "timeout_keep_alive": 3,
                                                              "access_log": False}
    config = uvicorn.Config("gateway.app:create_app", factory=True, **opts)  # names the installed uvicorn knows
    assert (config.limit_concurrency, config.timeout_keep_alive, config.access_log) == (7, 3, False)


async def _hello(scope, receive, send):
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


def _raw(port: int, *parts: bytes) -> tuple[int, socket.socket]:
    """Send a request in ``parts`` (a pause between them, so the server reads each on its own);
    the status code of the answer and the open socket."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    try:
        for i, part in enumerate(parts):
            if i:
                time.sleep(0.05)
            sock.sendall(part)
    except OSError:  # the server answered and closed before it had read everything
        pass
    head = sock.recv(65536).split(b"\r\n", 1)[0]
    return int(head.split()[1]), sock


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_a_real_uvicorn_with_those_options_refuses_a_huge_unfinished_head_and_too_many_clients():
    s = Settings(_env_file=None, http_max_header_bytes=2048, http_limit_concurrency=2)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_hello, host="127.0.0.1", port=port, log_level="warning",
                                           lifespan="off", **gateway_server_options(s)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        ok = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"
        status, held = _raw(port, ok)
        assert status == 200
        status, other = _raw(port, ok)  # a second connection (the limit counts the one asking)
        assert status == 503
        other.close()
        held.close()
        time.sleep(0.05)  # the server notices the closed connection
        # the bound is on what is read of an unfinished head (2 KiB here), as h11's: 1 KiB read,
        # then the rest, passes; 5 KiB read with the head still open is refused. A body beyond it is
        # no head: a 5 KiB POST passes, twice on one connection.
        post = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 6000\r\n\r\n" + b"b" * 6000
        status, sock = _raw(port, post[:1000], post[1000:])
        assert status == 200
        sock.sendall(post)
        assert sock.recv(65536).split(b"\r\n", 1)[0].split()[1] == b"200"
        sock.close()
        time.sleep(0.05)
        for first, expected in ((1024, 200), (5000, 400)):
            head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 5000 + b"\r\n\r\n"
            status, sock = _raw(port, head[:first], head[first:])
            sock.close()
            assert status == expected, first
            time.sleep(0.05)
    finally:
        server.should_exit = True
        thread.join(timeout=5)
