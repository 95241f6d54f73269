"""Admission records by group commit: the rows of admissions that arrive while a write is under
way are committed together in the next one, each admission returning once its rows are in; a
failed write fails the admissions it carried, and the next ones write again."""

from __future__ import annotations

import asyncio

from gateway import admission_records as module
from gateway.admission_records import AdmissionRecords


def test_a_burst_is_written_in_few_transactions(monkeypatch):
    calls: list[int] = []

    def record(db, rows):
        calls.append(len(rows))

    monkeypatch.setattr(module, "record_requests", record)

    async def scenario():
        writer = AdmissionRecords(db=object())
        await asyncio.gather(*(writer.write([{"id": f"r{i}"}]) for i in range(50)))

    asyncio.run(scenario())
    assert sum(calls) == 50 and len(calls) <= 3


def test_a_failed_write_fails_its_admissions_only(monkeypatch):
    calls: list[int] = []

    def record(db, rows):
        calls.append(len(rows))
        if len(calls) == 1:
            raise RuntimeError("database is locked")

    monkeypatch.setattr(module, "record_requests", record)

    async def scenario():
        writer = AdmissionRecords(db=object())
        first = await asyncio.gather(writer.write([{"id": "a"}]), return_exceptions=True)
        second = await asyncio.gather(writer.write([{"id": "b"}]), return_exceptions=True)
        return first, second

    first, second = asyncio.run(scenario())
    assert isinstance(first[0], RuntimeError) and second == [None] and calls == [1, 1]
