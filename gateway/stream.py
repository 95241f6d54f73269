"""Reading one request's Redis Stream: its StreamEvents in order, up to and including the final one.

The entries come from the gateway's one reader of every stream (gateway.stream_hub); this waits
for them in slices, and between slices checks whether the client is still there. A slice returns
as soon as an event arrives, so slicing adds no latency to the tokens themselves.

The reader owns the two reasons a request stops being wanted before its answer: the deadline
passed (``FailureCode.TIMEOUT``) or the client disconnected (``FailureCode.CANCELLED``); it raises
``Withdrawn`` and leaves what to do about it to the caller (gateway.relay withdraws the request).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable

from cohort import bus
from cohort.protocol import FailureCode, StreamEvent
from gateway.stream_hub import StreamHub


class Withdrawn(Exception):
    """The request was given up before its final event: ``code`` is CANCELLED or TIMEOUT."""

    def __init__(self, code: FailureCode) -> None:
        super().__init__(code.value)
        self.code = code


async def read_events(hub: StreamHub, request_id: str, deadline: float, slice_s: float,
                      disconnected: Callable[[], Awaitable[bool]] | None = None,
                      wake: bool = True) -> AsyncIterator[StreamEvent]:
    """The request's events in order, ending after the first final (end/error) one.

    ``deadline`` is a ``time.monotonic()`` instant; ``disconnected`` is polled at the start and
    then at most once per ``slice_s`` (``Settings.disconnect_check_s``), however many events arrive
    in between: each poll is a round of the ASGI receive channel, and a streaming client that left
    is noticed anyway when a write to it fails.
    ``wake``: see ``StreamHub.subscribe``. The stream is left in place (it expires with its TTL): the batcher reads a lost batch's
    streams to tell answered rows from unanswered ones (``bus.stream_progress``).
    """
    reader = await hub.subscribe(request_id, wake)
    checked = float("-inf")  # when ``disconnected`` was last asked: at most once a slice, not once an event
    try:
        while True:
            now = time.monotonic()
            if disconnected is not None and now - checked >= slice_s:
                checked = now
                if await disconnected():
                    raise Withdrawn(FailureCode.CANCELLED)
            left = deadline - now
            if left <= 0:
                raise Withdrawn(FailureCode.TIMEOUT)
            for item in await reader.next(min(slice_s, left)):  # stream entries, or events made here
                event = item if isinstance(item, StreamEvent) else StreamEvent.from_json(item[1][bus.STREAM_FIELD])
                yield event
                if event.final:
                    return
    finally:
        hub.unsubscribe(reader)
