"""Where a lost batch's rows resume: the batcher re-queues them from what their streams show."""

from __future__ import annotations

import redis
from sqlalchemy.engine import Engine

from cohort import bus
from cohort.logdb import settled_ids
from cohort.types import ProfiledRequest


def resume_points(r: redis.Redis, db: Engine, requests: list[ProfiledRequest]) -> list[ProfiledRequest]:
    """A lost batch's rows as they stand on their streams: answered rows are left out (never
    answered twice: a final event on the stream, or a settled log-DB record once the stream
    has expired) and rows that streamed tokens resume after them (the client already has that
    text) instead of starting again."""
    ids = [req.id for req in requests]
    progress = bus.stream_progress(r, ids)
    settled = settled_ids(db, ids)
    rest = []
    for req in requests:
        final, streamed = progress[req.id]
        if final or req.id in settled:
            continue
        done = req.generated_ids
        sent = streamed[len(done):] if streamed[:len(done)] == done else []
        rest.append(req.continuation(sent, None) if sent else req)
    return rest
