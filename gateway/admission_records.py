"""The log-DB rows of admitted requests, written by group commit: every admission that reaches this
point while a write is under way waits for the next one, which inserts all their rows in one
transaction. A request's row is still committed before it is queued (whoever sees the request finds
its record); what changes is that a burst of admissions costs a few transactions instead of one
each. Why: with SQLite every transaction takes the database's one write lock, which the workers'
writes contend for, and a burst of 300 admissions spent seconds waiting for it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

from cohort.logdb import record_requests


class AdmissionRecords:
    """One per gateway process (its event loop): ``await write(rows)`` returns once they are committed."""

    def __init__(self, db: Any) -> None:
        self.db = db
        self._pending: list[tuple[list[Mapping[str, Any]], asyncio.Future]] = []
        self._writing: asyncio.Task | None = None

    async def write(self, rows: list[Mapping[str, Any]]) -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._pending.append((rows, done))
        if self._writing is None or self._writing.done() or self._writing.get_loop() is not loop:
            self._pending = [(r, f) for r, f in self._pending if f.get_loop() is loop]  # another loop's are gone
            self._writing = loop.create_task(self._drain())
        await asyncio.shield(done)  # a client that leaves does not take the others' write with it

    async def _drain(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                # asyncio's own hop, not anyio's (starlette's run_in_threadpool): half its CPU, and
                # this is one a request at low rates (docs/notes/front.md, run 16)
                await asyncio.to_thread(record_requests, self.db, [row for rows, _ in batch for row in rows])
            except Exception as e:  # every admission of the batch fails as its own write would have
                for _, done in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            for _, done in batch:
                if not done.done():
                    done.set_result(None)
