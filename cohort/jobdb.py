"""The Batch API's durable state: uploaded files, batch jobs, their rows, API keys and
per-key usage — tables of the log DB, next to the request and batch-run records.

Why in the log DB and not in Redis: a job outlives any one process and a Redis restart; the
gateway (files, batches, keys) and the job runner (rows) are separate processes that share only
this DB. Every state change of a row is one guarded UPDATE (``settle_row`` only from ``running``),
so however many times a row is sent again after a crash, its answer is written once and a
``custom_id`` appears once in the output.
"""

from __future__ import annotations

import json
import time
from functools import lru_cache
from typing import Any

from sqlalchemy import Column, Float, Integer, String, Table, Text, func, select, update
from sqlalchemy.engine import Engine

from cohort.logdb import create_tables, get_db_engine, metadata

files = Table(
    "files", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, default="", index=True),  # api key id; "" = open API
    Column("created_at", Integer, nullable=False, index=True),
    Column("bytes", Integer, nullable=False),
    Column("filename", String(512), nullable=False),
    Column("purpose", String(32), nullable=False),
)

batch_jobs = Table(
    "batch_jobs", metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False, default="", index=True),
    Column("created_at", Integer, nullable=False, index=True),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    Column("completion_window", String(16), nullable=False),
    Column("status", String(16), nullable=False, index=True),
    Column("metadata", Text),          # JSON object or null
    Column("errors", Text),            # JSON list of {code, message, param, line} or null
    Column("output_file_id", String(64)),
    Column("error_file_id", String(64)),
    Column("expires_at", Integer),
    Column("in_progress_at", Integer),
    Column("finalizing_at", Integer),
    Column("completed_at", Integer),
    Column("failed_at", Integer),
    Column("expired_at", Integer),
    Column("cancelling_at", Integer),
    Column("cancelled_at", Integer),
    Column("total", Integer, default=0),
    Column("completed", Integer, default=0),
    Column("failed", Integer, default=0),
)

# The endpoints a batch's rows may call (POST /v1/batches checks it; `cohort batch run` reads it).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")

ROW_PENDING, ROW_RUNNING, ROW_DONE, ROW_ERROR = "pending", "running", "done", "error"

batch_rows = Table(
    "batch_rows", metadata,
    Column("id", String(96), primary_key=True),          # <batch id>:<line index>
    Column("batch_id", String(64), nullable=False, index=True),
    Column("idx", Integer, nullable=False),
    Column("custom_id", Text),
    Column("body", Text),                                # the request body as JSON
    Column("status", String(16), nullable=False, index=True),  # pending|running|done|error
    Column("attempts", Integer, default=0),
    Column("line", Text),                                # its output or error file line, once settled
    Column("finished", Float),
)

api_keys = Table(
    "api_keys", metadata,
    Column("id", String(64), primary_key=True),
    Column("hash", String(64), nullable=False, unique=True),   # sha256 of the key: the key itself is never kept
    Column("name", String(128)),
    Column("prefix", String(16)),                               # its first characters, to recognise it in a list
    Column("created", Float, nullable=False),
    Column("revoked", Float),
    Column("rpm", Integer),                                     # null: COHORT_API_KEY_RPM
    Column("tpm", Integer),
)

key_usage = Table(
    "key_usage", metadata,
    Column("key_id", String(64), primary_key=True),
    Column("requests", Integer, default=0),
    Column("prompt_tokens", Integer, default=0),
    Column("completion_tokens", Integer, default=0),
    Column("updated", Float),
)

TABLES = [files, batch_jobs, batch_rows, api_keys, key_usage]


@lru_cache(maxsize=8)
def jobs_engine(url: str) -> Engine:
    """The log DB's engine with the Batch API's tables created (once per URL per process)."""
    engine = get_db_engine(url)
    create_tables(engine, TABLES)
    return engine


def _now() -> int:
    return int(time.time())


# --- files -------------------------------------------------------------------------------------

def add_file(engine: Engine, row: dict[str, Any]) -> None:
    with engine.begin() as conn:
        conn.execute(files.insert().values(**row))


def _owned_row(engine: Engine, table: Table, row_id: str, owner: str | None) -> dict[str, Any] | None:
    """A record by id, or None when there is none or it is another key's (``owner`` None: any)."""
    q = select(table).where(table.c.id == row_id)
    if owner is not None:
        q = q.where(table.c.owner == owner)
    with engine.connect() as conn:
        r = conn.execute(q).first()
    return dict(r._mapping) if r else None


def get_file(engine: Engine, file_id: str, owner: str | None) -> dict[str, Any] | None:
    """The file's record, or None when there is none or it is another key's (``owner`` None: any)."""
    return _owned_row(engine, files, file_id, owner)


def list_files(engine: Engine, owner: str, purpose: str | None = None, after: str | None = None,
               limit: int = 10000) -> list[dict[str, Any]]:
    """An owner's files, newest first."""
    q = select(files).where(files.c.owner == owner)
    if purpose:
        q = q.where(files.c.purpose == purpose)
    with engine.connect() as conn:
        rows = [dict(r._mapping) for r in conn.execute(q.order_by(files.c.created_at.desc(), files.c.id.desc()))]
    if after:
        ids = [r["id"] for r in rows]
        rows = rows[ids.index(after) + 1:] if after in ids else []
    return rows[:limit]


def delete_file(engine: Engine, file_id: str) -> None:
    with engine.begin() as conn:
        conn.execute(files.delete().where(files.c.id == file_id))


# --- batch jobs --------------------------------------------------------------------------------

def create_batch(engine: Engine, row: dict[str, Any]) -> None:
    with engine.begin() as conn:
        conn.execute(batch_jobs.insert().values(**row))


def get_batch(engine: Engine, batch_id: str, owner: str | None = None) -> dict[str, Any] | None:
    return _owned_row(engine, batch_jobs, batch_id, owner)


def list_batches(engine: Engine, owner: str, after: str | None, limit: int) -> tuple[list[dict[str, Any]], bool]:
    """(an owner's batches newest first after the one named ``after``, whether there are more)."""
    q = select(batch_jobs).where(batch_jobs.c.owner == owner)
    with engine.begin() as conn:
        if after and (ref := conn.execute(select(batch_jobs.c.created_at).where(batch_jobs.c.id == after)).first()):
            t = ref[0]
            q = q.where((batch_jobs.c.created_at < t) | ((batch_jobs.c.created_at == t) & (batch_jobs.c.id < after)))
        q = q.order_by(batch_jobs.c.created_at.desc(), batch_jobs.c.id.desc()).limit(limit + 1)
        rows = [dict(r._mapping) for r in conn.execute(q)]
    return rows[:limit], len(rows) > limit


def set_batch(engine: Engine, batch_id: str, *, from_status: tuple[str, ...] | None = None, **values: Any) -> bool:
    """Change a batch (``from_status``: only while it is in one of these). Returns whether it changed."""
    q = update(batch_jobs).where(batch_jobs.c.id == batch_id)
    if from_status:
        q = q.where(batch_jobs.c.status.in_(from_status))
    with engine.begin() as conn:
        return bool(conn.execute(q.values(**values)).rowcount)


def batches_in(engine: Engine, statuses: tuple[str, ...]) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        q = select(batch_jobs).where(batch_jobs.c.status.in_(statuses)).order_by(batch_jobs.c.created_at)
        return [dict(r._mapping) for r in conn.execute(q)]


# --- rows --------------------------------------------------------------------------------------

def insert_rows(engine: Engine, batch_id: str, rows: list[dict[str, Any]]) -> None:
    """A job's rows as validated: ``{idx, custom_id, body}`` pending, or with ``line`` already an error."""
    if not rows:
        return
    now = time.time()
    with engine.begin() as conn:
        conn.execute(batch_rows.insert(), [
            {"id": f"{batch_id}:{r['idx']}", "batch_id": batch_id, "idx": r["idx"], "custom_id": r.get("custom_id"),
             "body": json.dumps(r["body"]) if r.get("body") is not None else None,
             "status": ROW_ERROR if r.get("line") else ROW_PENDING, "attempts": 0, "line": r.get("line"),
             "finished": now if r.get("line") else None} for r in rows])


def claim_rows(engine: Engine, batch_id: str, n: int) -> list[dict[str, Any]]:
    """Up to ``n`` pending rows of a job, now ``running`` (one runner: no two claim the same row)."""
    with engine.begin() as conn:
        rows = [dict(r._mapping) for r in conn.execute(
            select(batch_rows).where(batch_rows.c.batch_id == batch_id, batch_rows.c.status == ROW_PENDING)
            .order_by(batch_rows.c.idx).limit(n))]
        for r in rows:
            conn.execute(update(batch_rows).where(batch_rows.c.id == r["id"])
                         .values(status=ROW_RUNNING, attempts=batch_rows.c.attempts + 1))
            r["attempts"] += 1
    return rows


def settle_row(engine: Engine, row_id: str, status: str, line: str) -> bool:
    """Write a running row's answer (``done``) or final error: once. False when it was not running
    (settled already, or cancelled/expired meanwhile)."""
    with engine.begin() as conn:
        res = conn.execute(update(batch_rows).where(batch_rows.c.id == row_id, batch_rows.c.status == ROW_RUNNING)
                           .values(status=status, line=line, finished=time.time()))
        return bool(res.rowcount)


def release_row(engine: Engine, row_id: str, refund: bool = False) -> None:
    """A running row goes back to pending (a transient failure: it is sent again); ``refund``:
    the attempt does not count (the request never reached the gateway)."""
    values: dict[str, Any] = {"status": ROW_PENDING}
    if refund:
        values["attempts"] = batch_rows.c.attempts - 1
    with engine.begin() as conn:
        conn.execute(update(batch_rows).where(batch_rows.c.id == row_id, batch_rows.c.status == ROW_RUNNING)
                     .values(**values))


def release_all_running(engine: Engine) -> int:
    """At a runner's start: rows a previous runner left running are pending again, their attempt
    refunded, so they are sent with the same request id and re-attach to their requests if those
    still run (cohort.apikeys.row_request_id). Returns how many."""
    with engine.begin() as conn:
        return int(conn.execute(update(batch_rows).where(batch_rows.c.status == ROW_RUNNING)
                                .values(status=ROW_PENDING, attempts=batch_rows.c.attempts - 1)).rowcount or 0)


def close_open_rows(engine: Engine, batch_id: str, line_for) -> int:
    """Settle every row of a job that has no answer (pending or running) as an error whose line is
    ``line_for(row)`` (cancelled, expired). Returns how many."""
    with engine.begin() as conn:
        rows = [dict(r._mapping) for r in conn.execute(select(batch_rows).where(
            batch_rows.c.batch_id == batch_id, batch_rows.c.status.in_((ROW_PENDING, ROW_RUNNING))))]
        for r in rows:
            conn.execute(update(batch_rows).where(batch_rows.c.id == r["id"], batch_rows.c.status == r["status"])
                         .values(status=ROW_ERROR, line=line_for(r), finished=time.time()))
    return len(rows)


def row_counts(engine: Engine, batch_id: str) -> dict[str, int]:
    """How many rows of a job are in each state."""
    with engine.connect() as conn:
        q = select(batch_rows.c.status, func.count()).where(batch_rows.c.batch_id == batch_id).group_by(batch_rows.c.status)
        return {s: int(n) for s, n in conn.execute(q)}


def settled_lines(engine: Engine, batch_id: str, status: str) -> list[str]:
    """The output (``done``) or error lines of a job, in input order."""
    with engine.connect() as conn:
        q = (select(batch_rows.c.line).where(batch_rows.c.batch_id == batch_id, batch_rows.c.status == status)
             .order_by(batch_rows.c.idx))
        return [r[0] for r in conn.execute(q)]


# --- API keys and usage ------------------------------------------------------------------------

def add_key(engine: Engine, row: dict[str, Any]) -> None:
    with engine.begin() as conn:
        conn.execute(api_keys.insert().values(**row))


def revoke_key(engine: Engine, key_id: str) -> bool:
    with engine.begin() as conn:
        return bool(conn.execute(update(api_keys).where(api_keys.c.id == key_id, api_keys.c.revoked.is_(None))
                                 .values(revoked=time.time())).rowcount)


def list_keys(engine: Engine) -> list[dict[str, Any]]:
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(select(api_keys).order_by(api_keys.c.created))]


def add_usage(engine: Engine, key_id: str, requests: int, prompt_tokens: int, completion_tokens: int) -> None:
    """Add to a key's running totals (insert on first use)."""
    c = key_usage.c
    with engine.begin() as conn:
        res = conn.execute(update(key_usage).where(c.key_id == key_id).values(
            requests=c.requests + requests, prompt_tokens=c.prompt_tokens + prompt_tokens,
            completion_tokens=c.completion_tokens + completion_tokens, updated=time.time()))
        if not res.rowcount:
            conn.execute(key_usage.insert().values(key_id=key_id, requests=requests, prompt_tokens=prompt_tokens,
                                                   completion_tokens=completion_tokens, updated=time.time()))


def usage_by_key(engine: Engine) -> dict[str, dict[str, Any]]:
    with engine.connect() as conn:
        return {r.key_id: {"requests": r.requests, "prompt_tokens": r.prompt_tokens,
                           "completion_tokens": r.completion_tokens} for r in conn.execute(select(key_usage))}
