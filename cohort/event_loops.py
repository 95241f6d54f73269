"""The event loop a thread of cohort's own runs: uvloop's where it is installed (it comes with
``uvicorn[standard]``, the loop the gateway already serves on), else asyncio's.

uvloop runs a loop's turn, its sockets and its timers in C: the upstream worker's engine loop, which
wakes several times for every request it admits, spends a good part of its CPU in asyncio's own
Python turn otherwise. Its timers fire to the millisecond and up to half a millisecond early, which
nothing that uses this needs finer.
"""

from __future__ import annotations

import asyncio

try:
    import uvloop
except ImportError:  # where uvloop does not build (Windows, PyPy)
    uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return asyncio.new_event_loop() if uvloop is None else uvloop.new_event_loop()
