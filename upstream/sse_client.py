"""An engine's streamed completion read on a bare asyncio protocol: HTTP/1.1 parsed by httptools
(llhttp, the parser uvicorn serves with), SSE ``data:`` lines parsed where the bytes arrive, and
each piece handed to a callback there, with no task woken per token.

Why not aiohttp here: reading one token of a stream through aiohttp's response, its line reader
and an async iterator cost the gateway about 55 µs of CPU on the 2-core development box, against
33 µs on a protocol (a token is one wake-up either way; the rest is the layers), and a request's
set-up 80 µs more. A gateway streams every token of every row, so that is most of its per-token
cost (docs/notes/front.md). aiohttp still serves everything else upstream (probes, /health,
/metrics), where nothing is per token.

What a stream guarantees, whichever way it ends:

* ``UpstreamRefused`` for a 4xx (but 408 and 429), with the server's body; ``UpstreamDown`` for
  anything else that is not a whole stream: a 5xx, a refused or broken connection, silence past
  ``read_timeout_s``, an ``error`` event mid-stream, an unreadable line, a body cut short. A whole
  body without ``[DONE]`` ends the stream as ``[DONE]`` would: whether it said how it finished is
  for the caller to judge, from the pieces.
* A stream the callback ends (a stop string) or its caller cancels (the client left) closes its
  connection, which makes vLLM abort the request. Only a stream read to its end goes back to the
  pool, which keeps a few idle connections a server for ``IDLE_KEEP_S`` (vLLM's uvicorn closes
  them after 5 s); a request whose reused connection closes before any byte of an answer is sent
  again once on a new one (the server closed it idle, before reading it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import httptools

from upstream.chunks import Chunk, UpstreamDown, UpstreamRefused, parse_chunk

IDLE_KEEP_S = 2.0          # an idle connection is reused this long (servers close theirs after 5 s or more)
IDLE_PER_SERVER = 64       # idle connections kept a server
MAX_LINE = 16 << 20        # one SSE line (a chunk with logprobs) may be this long
ERROR_BODY = 2000          # characters of a refusal's body kept for its message

OnChunk = Callable[[Chunk], bool]  # True: the caller is done (the stream is closed)


class _Stream(asyncio.Protocol):
    """One HTTP/1.1 connection: a request at a time, its answer parsed as it arrives."""

    def __init__(self, loop: asyncio.AbstractEventLoop, read_timeout_s: float) -> None:
        self.loop, self.read_timeout_s = loop, read_timeout_s
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self._parser = httptools.HttpResponseParser(self)
        self._reset(None, None)

    def _reset(self, on_chunk: OnChunk | None, done: asyncio.Future | None) -> None:
        self.on_chunk, self.done = on_chunk, done
        self.status = 0
        self.got_bytes = False   # any byte of this request's answer
        self.complete = False    # the whole HTTP message arrived
        self.ended = False       # [DONE] seen, or the callback ended it
        self._line = b""
        self._error_body = b""
        self._framed = False     # a Content-Length or chunked body (else it runs to the connection's end)
        self._keep_alive = False
        self._last = time.monotonic()
        self._timer: asyncio.TimerHandle | None = None

    # --- the caller's side ---------------------------------------------------------------------
    def send(self, request: bytes, on_chunk: OnChunk) -> asyncio.Future:
        assert self.transport is not None
        self._parser = httptools.HttpResponseParser(self)
        self._reset(on_chunk, self.loop.create_future())
        self._timer = self.loop.call_later(self.read_timeout_s, self._check_silence)
        self.transport.write(request)
        return self.done

    def reusable(self) -> bool:
        return (self.transport is not None and not self.transport.is_closing() and self.complete
                and self._keep_alive)

    def close(self) -> None:
        self._stop_timer()
        if self.transport is not None:
            self.transport.close()

    # --- asyncio's side ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_timer()
        if self.complete or (self.ended and self.status < 400):  # answered already, or read to [DONE]
            self._resolve()
        elif self.status and not self._framed and exc is None:  # a body that runs to the connection's end
            self.on_message_complete()
        else:
            why = f"{type(exc).__name__}: {exc}" if exc else "the server closed the connection"
            self._fail(UpstreamDown(f"the stream broke ({why})"))

    def data_received(self, data: bytes) -> None:
        self.got_bytes = True
        self._last = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:  # a callback's own failure is its context
            cause = e.__context__ or e
            self._abort(UpstreamDown(f"an unreadable answer: {type(cause).__name__}: {cause}"))

    # --- httptools' callbacks ------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        low = name.lower()
        if low == b"content-length" or (low == b"transfer-encoding" and b"chunked" in value.lower()):
            self._framed = True

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self._keep_alive = self._parser.should_keep_alive()  # llhttp forgets it once the message is over

    def on_body(self, body: bytes) -> None:
        if self.done is None or self.done.done():
            return
        if self.status >= 400:
            self._error_body = (self._error_body + body)[:4 * ERROR_BODY]
            return
        lines = (self._line + body).split(b"\n")
        self._line = lines.pop()
        if len(self._line) > MAX_LINE:
            self._abort(UpstreamDown(f"a stream line longer than {MAX_LINE} bytes"))
        for line in lines:
            if self.ended or self.done.done():  # [DONE], the caller's end, or a failure: nothing more is read
                return
            if line.startswith(b"data:"):
                self._data(line[5:].strip())

    def on_message_complete(self) -> None:
        self.complete = True
        self._stop_timer()
        if self.status >= 400:
            text = self._error_body.decode(errors="replace")[:ERROR_BODY]
            kind = UpstreamRefused if self.status < 500 and self.status not in (408, 429) else UpstreamDown
            self._fail(kind(f"{self.status}: {text}"))
        else:
            self._resolve()

    # --- one line ------------------------------------------------------------------------------
    def _data(self, data: bytes) -> None:
        if data == b"[DONE]":
            self.ended = True
            return
        try:
            obj = json.loads(data)
        except ValueError as e:
            self._abort(UpstreamDown(f"unreadable stream: {e}"))
            return
        if "error" in obj:  # an error event mid-stream
            self._abort(UpstreamDown(json.dumps(obj["error"])[:500]))
            return
        assert self.on_chunk is not None
        try:
            finished = self.on_chunk(parse_chunk(obj))
        except Exception as e:  # the caller's own failure ends its stream, as an exception would
            self._abort(e)
            return
        if finished:
            self.ended = True
            self._resolve()
            self.close()  # vLLM aborts the request; the rest of what arrived is not read

    def _check_silence(self) -> None:
        quiet = time.monotonic() - self._last
        if quiet >= self.read_timeout_s:
            self._timer = None
            self._abort(UpstreamDown(f"no byte for {self.read_timeout_s:g} s"))
        else:
            self._timer = self.loop.call_later(self.read_timeout_s - quiet, self._check_silence)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _abort(self, e: BaseException) -> None:
        self._fail(e)
        self.close()

    def _resolve(self) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_result(None)

    def _fail(self, e: BaseException) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(e)


class SSEClient:
    """Streamed completions against OpenAI-compatible servers, with their connections pooled."""

    def __init__(self, *, headers: dict[str, str] | None = None, read_timeout_s: float = 60.0,
                 connect_timeout_s: float | None = None) -> None:
        """``connect_timeout_s``: by default the read timeout, up to 30 s."""
        self.headers = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        self.read_timeout_s = read_timeout_s
        self.connect_timeout_s = min(read_timeout_s, 30.0) if connect_timeout_s is None else connect_timeout_s
        self._idle: dict[tuple[str, str, int], list[_Stream]] = {}
        self._ssl: ssl.SSLContext | None = None

    async def stream(self, url: str, payload: dict[str, Any], on_chunk: OnChunk) -> None:
        """POST ``payload`` to ``url`` (``…/v1/completions``) and hand each piece to ``on_chunk`` as
        it arrives, until the stream ends, ``on_chunk`` returns True, or it fails (the module
        docstring says how). Cancelling the caller closes the connection."""
        parts = urlsplit(url)
        secure = parts.scheme == "https"
        key = (parts.scheme, parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80))
        body = json.dumps(payload, separators=(",", ":")).encode()
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        host = parts.netloc.rpartition("@")[2]
        request = (f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                   f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\n{self.headers}\r\n").encode() + body
        for attempt in (0, 1):
            conn, reused = self._take(key), True
            if conn is None:
                conn, reused = await self._connect(key, secure), False
            done = conn.send(request, on_chunk)
            try:
                await done
            except UpstreamDown:
                if reused and not conn.got_bytes and attempt == 0:
                    conn.close()
                    continue  # the server closed it while idle, before reading the request: once more
                conn.close()
                raise
            except BaseException:  # refused, cancelled (the client left), the caller's own error
                conn.close()
                raise
            self._give_back(key, conn)
            return

    async def chunks(self, url: str, payload: dict[str, Any]) -> AsyncIterator[Chunk]:
        """``stream`` as an async iterator, for a caller that awaits between pieces (the upstream
        worker's relayed rows); closing it early closes the connection."""
        got: asyncio.Queue[Chunk | None] = asyncio.Queue()

        def take(ch: Chunk) -> bool:
            got.put_nowait(ch)
            return False  # the iterator's consumer ends it by closing it

        async def run() -> None:
            try:
                await self.stream(url, payload, take)
            finally:
                got.put_nowait(None)

        task = asyncio.get_running_loop().create_task(run())
        try:
            while (ch := await got.get()) is not None:
                yield ch
            await task  # its failure, if it failed
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def _take(self, key: tuple[str, str, int]) -> _Stream | None:
        idle = self._idle.get(key)
        now, loop = time.monotonic(), asyncio.get_running_loop()
        while idle:
            conn = idle.pop()
            if (conn.loop is loop and conn.transport is not None and not conn.transport.is_closing()
                    and now - conn.idle_since < IDLE_KEEP_S):
                return conn
            if conn.loop is loop:  # one of another loop (a probe's, run on its own) is that loop's to close
                conn.close()
        return None

    def _give_back(self, key: tuple[str, str, int], conn: _Stream) -> None:
        idle = self._idle.setdefault(key, [])
        if conn.reusable() and len(idle) < IDLE_PER_SERVER:
            conn.idle_since = time.monotonic()
            conn.on_chunk = None
            idle.append(conn)
        else:
            conn.close()

    async def _connect(self, key: tuple[str, str, int], secure: bool) -> _Stream:
        loop = asyncio.get_running_loop()
        if secure and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Stream(loop, self.read_timeout_s), key[1], key[2],
                                                       ssl=self._ssl if secure else None)
        except (OSError, TimeoutError) as e:
            raise UpstreamDown(f"cannot connect to {key[1]}:{key[2]} ({type(e).__name__}: {e})") from e
        return conn

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                with contextlib.suppress(Exception):
                    conn.close()
        self._idle.clear()
