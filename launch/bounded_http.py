"""The gateway's HTTP/1.1 protocol: uvicorn's httptools parser, with a bound on an unfinished
request head.

Why not h11, which uvicorn bounds itself (``h11_max_incomplete_event_size``): h11 parses and
frames in pure Python, and every streamed SSE chunk of every answer passes through it. With
httptools (C) the gateway spent ~1 ms less CPU per streamed request (docs/notes/upstream.md), on the
core it shares with the batcher and the workers. httptools itself reads a head of any size, so
this protocol keeps h11's rule: the bytes read while a head is still open may not exceed
``max_head_bytes`` (COHORT_HTTP_MAX_HEADER_BYTES); beyond it the client is answered 400 and the
connection closed. A head that completes within the read that crosses the bound passes, as with h11.
"""

from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from cohort.settings import get_settings


class BoundedHttpTools(HttpToolsProtocol):
    max_head_bytes = 16_384

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._head_open = True  # waiting for, or reading, a request's head
        self._head_bytes = 0

    def data_received(self, data: bytes) -> None:
        if self._head_open:
            self._head_bytes += len(data)
        super().data_received(data)  # the head's end resets the count (on_headers_complete)
        if self._head_open and self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
            self.send_400_response("Request head too large.")

    def on_headers_complete(self) -> None:
        self._head_open, self._head_bytes = False, 0
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._head_open, self._head_bytes = True, 0


def bounded_http(max_head_bytes: int) -> type[BoundedHttpTools]:
    """The protocol class uvicorn builds per connection, with this bound."""
    return type("BoundedHttpTools", (BoundedHttpTools,), {"max_head_bytes": max_head_bytes})


class SettingsBoundedHttpTools(BoundedHttpTools):
    """The bound from the process's own settings (COHORT_HTTP_MAX_HEADER_BYTES): the class several
    gateway processes name (``launch.bounded_http:SettingsBoundedHttpTools``), since uvicorn's
    process manager hands its children the configuration by value and a class made at run time
    (``bounded_http``) cannot cross."""

    @property
    def max_head_bytes(self) -> int:  # type: ignore[override]
        return get_settings().http_max_header_bytes
