"""One blocking XREAD for every answer stream the gateway relays (``StreamHub``).

Why: with a blocking XREAD per request, the event loop pays one Redis round trip (command
encoding, reply parsing, a pooled connection held while blocked) per event batch per request. In a
burst of 300 streamed requests that was 45 % of the gateway's main thread (py-spy, docs/notes/upstream.md
"The gateway's intake"), more than admission itself, and the relaying of early requests' tokens
delayed the admission of later ones. The hub reads every followed stream in one call, which
returns all their new entries at once, and hands each reader its own.

A reader that subscribes while the call is blocked wakes it through a stream of the hub's own
(one XADD per blocked call, however many subscribe meanwhile), so its first tokens wait for
nothing; one whose tokens this gateway streams itself need not (``subscribe(wake=False)``). Two
readers of one request (a Batch API row sent again) each get every entry: the call reads each
stream from its slowest reader's position. An error of the call (Redis gone) reaches
every reader, as its own read would have; the next reader starts a new call.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

from cohort import bus

Entries = list[tuple[str, dict[str, str]]]


def _stream_id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


class Reader:
    """One request's place in the hub: its stream, the last entry it was given, what is waiting."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.last = "0"
        self._queue: asyncio.Queue[Entries | BaseException] = asyncio.Queue()

    def deliver(self, entries: Entries) -> None:
        last = _stream_id(self.last)
        if new := [e for e in entries if _stream_id(e[0]) > last]:
            self.last = new[-1][0]
            self._queue.put_nowait(new)

    def fail(self, exc: BaseException) -> None:
        self._queue.put_nowait(exc)

    def push(self, events: list) -> None:
        """Events this gateway made itself (a row it streams from its engine: ``upstream.direct``),
        given as they are, beside the stream's entries."""
        self._queue.put_nowait(events)

    async def next(self, timeout_s: float) -> Entries:
        """The entries that arrived since the last call, waiting up to ``timeout_s`` (then none)."""
        if self._queue.empty():
            try:
                async with asyncio.timeout(timeout_s):
                    got = await self._queue.get()
            except TimeoutError:
                return []
        else:
            got = self._queue.get_nowait()
        if isinstance(got, BaseException):
            raise got
        return got


class StreamHub:
    """Follows the answer streams of the requests this gateway relays, with one blocking call."""

    def __init__(self, redis: Any, block_s: float) -> None:
        self.redis = redis
        # the blocking reads hold one connection of their own: taking it from the pool and giving
        # it back around every read cost as much CPU as the read's reply
        self._reads = redis.client()
        self.loop = asyncio.get_running_loop()
        self.block_ms = max(1, int(block_s * 1000))
        self.readers: dict[str, list[Reader]] = {}
        self._early: dict[str, tuple[float, list]] = {}  # local events of a request not followed yet
        self._wake_key, self._wake_last = bus.hub_wake_key(uuid.uuid4().hex), "0"
        self._task: asyncio.Task | None = None
        self._blocked = self._woken = False
        self._retired = self._released = False

    async def subscribe(self, request_id: str, wake: bool = True) -> Reader:
        """Follow ``request_id``'s stream from its first entry; ``unsubscribe`` when done.
        ``wake=False``: a blocked call is left to run out (at most ``block_s``) and the next one
        reads this stream from its start, so nothing is missed, only later: for a request whose
        tokens this gateway streams itself (``push_local``), whose stream carries only failures,
        that saves the wake and a call of every followed stream, two round trips a request."""
        reader = Reader(bus.stream_key(request_id))
        self.readers.setdefault(reader.key, []).append(reader)
        if early := self._early.pop(reader.key, None):
            reader.push(early[1])
        if self._task is None or self._task.done():
            self._task = self.loop.create_task(self._run())
        elif wake and self._blocked and not self._woken:  # the call under way does not read this stream: end it
            self._woken = True
            try:
                pipe = self.redis.pipeline(transaction=False)
                pipe.xadd(self._wake_key, {"w": "1"}, maxlen=1, approximate=False)
                pipe.expire(self._wake_key, 3600)
                await pipe.execute()
            except BaseException:  # Redis gone or the client left: nobody will read for this reader
                self._woken = False
                self.unsubscribe(reader)
                raise
        return reader

    def push_local(self, request_id: str, events: list) -> None:
        """Hand this gateway's own events of ``request_id`` to its readers; kept a while for a reader
        that has not subscribed yet (its release came before its relay began to follow it)."""
        key = bus.stream_key(request_id)
        readers = self.readers.get(key)
        if readers:
            for reader in readers:
                reader.push(events)
            return
        now = time.monotonic()
        if len(self._early) > 1000:  # nobody came for these: their clients left
            self._early = {k: v for k, v in self._early.items() if now - v[0] < 60.0}
        self._early.setdefault(key, (now, []))[1].extend(events)

    async def aclose(self) -> None:
        """At shutdown: stop reading, fail the readers still waiting (as a lost Redis would), and
        give the reading connection back to the pool (the pool stays open: it is the app's)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(BaseException):
                await self._task
        for readers in self.readers.values():
            for reader in readers:
                reader.fail(ConnectionError("the gateway is shutting down"))
        await self._reads.aclose(close_connection_pool=False)

    def retire(self) -> None:
        """Replaced by another hub: keep serving the readers this one has, then give the reading
        connection back (at once where nothing is being read)."""
        self._retired = True
        if self._task is None or self._task.done():
            self._let_go()

    def _let_go(self) -> None:
        """A retired hub gives its reading connection back, once."""
        if self._retired and not self._released:
            self._released = True
            _close_later(self.loop, self._reads)

    def unsubscribe(self, reader: Reader) -> None:
        readers = self.readers.get(reader.key, [])
        if reader in readers:
            readers.remove(reader)
        if not readers:
            self.readers.pop(reader.key, None)
        if not self.readers and (self._task is None or self._task.done()):
            self._let_go()  # its read failed with readers left: they are gone now

    async def _run(self) -> None:
        me = asyncio.current_task()
        try:
            while self.readers and not (me and me.cancelling()):  # a client may swallow a cancel
                streams = {self._wake_key: self._wake_last}
                for key, readers in self.readers.items():  # nearly always one reader a stream
                    streams[key] = readers[0].last if len(readers) == 1 else min((r.last for r in readers), key=_stream_id)
                self._blocked, self._woken = True, False
                started = time.monotonic()
                try:
                    got = await self._reads.xread(streams, block=self.block_ms)
                finally:
                    self._blocked = False
                if not got and time.monotonic() - started < self.block_ms / 2000:
                    await asyncio.sleep(0.01)  # an empty answer before its time (fakeredis): no spinning
                for key, entries in got or ():
                    if key == self._wake_key:
                        self._wake_last = entries[-1][0]
                        continue
                    for reader in self.readers.get(key, ()):
                        reader.deliver(entries)
        except Exception as exc:  # Redis gone: every reader fails as its own read would have
            for readers in self.readers.values():
                for reader in readers:
                    reader.fail(exc)
        finally:
            if not self.readers:
                self._let_go()


_CLOSING: set[asyncio.Task] = set()


def _close_later(loop: asyncio.AbstractEventLoop, client: Any) -> None:
    """Give a hub's reading connection back without waiting for it (the task is held until done:
    the loop keeps only a weak reference)."""
    task = loop.create_task(client.aclose(close_connection_pool=False))
    _CLOSING.add(task)
    task.add_done_callback(_CLOSING.discard)


def hub_for(app_state: Any) -> StreamHub:
    """The app's hub on the running event loop and its Redis client (made on first use). A hub
    replaced on this loop (the app's client changed) retires: it gives its reading connection back
    once its readers are done; one left on another loop goes when that loop does."""
    hub = getattr(app_state, "stream_hub", None)
    loop = asyncio.get_running_loop()
    if hub is None or hub.redis is not app_state.redis or hub.loop is not loop:
        if hub is not None and hub.loop is loop:
            hub.retire()
        hub = app_state.stream_hub = StreamHub(app_state.redis, app_state.settings.disconnect_check_s)
    return hub


async def close_hub(app_state: Any) -> None:
    """At shutdown: stop the app's hub and give back its connection before the pool closes."""
    hub = getattr(app_state, "stream_hub", None)
    if hub is not None and hub.loop is asyncio.get_running_loop():
        await hub.aclose()
