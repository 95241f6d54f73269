"""The log DB: one row per request and per batch run, the raw material of continuous learning.

SQLAlchemy Core so the same code runs on SQLite (embedded default, WAL mode for several
processes) and PostgreSQL (``COHORT_DATABASE_URL=postgresql+psycopg://...``). Writes are
idempotent upserts keyed by id: a re-delivered batch never writes a record twice.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from sqlalchemy import (
    Boolean,
    Column,
    Float,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    bindparam,
    create_engine,
    event,
    func,
    inspect,
    select,
    update,
)
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import DBAPIError

metadata = MetaData()

requests = Table(
    "requests", metadata,
    Column("id", String(64), primary_key=True),
    Column("created", Float, nullable=False, index=True),
    Column("model", String(256)),
    Column("task", String(64)),
    Column("instruction", Text),
    Column("user_input", Text),
    Column("input_tokens", Integer),
    Column("max_tokens", Integer),
    Column("predicted_tokens", Integer),
    Column("predictor_version", String(64)),
    Column("predicted_upper", Integer),  # the q90 bound memory planning used: live coverage
    Column("actual_tokens", Integer),
    Column("cached_tokens", Integer),  # prompt tokens whose KV the instance's prefix cache had
    Column("emulated_tokens", Integer),
    Column("slo_s", Float),
    Column("status", String(16), nullable=False, default="queued"),  # queued|done|failed|cancelled|timeout
    Column("error", Text),
    Column("batch_id", String(64)),
    Column("queued_s", Float),
    Column("run_s", Float),
    Column("total_s", Float),
    Column("finished", Float, index=True),
)

batches = Table(
    "batches", metadata,
    Column("id", String(64), primary_key=True),
    Column("created", Float, nullable=False),
    Column("started", Float),
    Column("finished", Float, index=True),
    Column("instance", String(128)),
    Column("model", String(256)),
    Column("size", Integer),
    Column("input_len", Integer),            # L(B)
    Column("predicted_gen_len", Integer),    # G'(B) as planned
    Column("actual_gen_len", Integer),       # G(B) as run
    Column("estimated_s", Float),
    Column("batch_time_s", Float),
    Column("peak_mem_bytes", Integer),
    Column("oom", Boolean, default=False),
    Column("attempt", Integer, default=0),
    Column("splits", Integer, default=0),
    Column("wma", Integer),
)


@lru_cache(maxsize=8)
def get_db_engine(url: str) -> Engine:
    """One engine per URL per process; creates the tables (and the SQLite folder) on first use."""
    if url.startswith("sqlite:///"):
        path = url.removeprefix("sqlite:///")
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(url, connect_args={"timeout": 30})

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(conn, _record):  # several processes write: WAL + busy timeout
            cur = conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.close()
    else:
        engine = create_engine(url, pool_pre_ping=True)
    create_tables(engine)
    add_missing_columns(engine)
    return engine


CREATE_ATTEMPTS = 5


def create_tables(engine: Engine, tables: Sequence[Table] | None = None) -> None:
    """``metadata.create_all`` (all its tables, or ``tables``), safe when several processes open a
    new DB at once: each looks for a table and then creates it, so two can both find it missing and
    the second's CREATE fails (seen: two gateway processes starting on a new SQLite file, "table
    files already exists", and the process that lost the race died). The loser tries again, and
    then finds the table."""
    for attempt in range(CREATE_ATTEMPTS):
        try:
            metadata.create_all(engine, tables=tables)
            return
        except DBAPIError:
            if attempt == CREATE_ATTEMPTS - 1:
                raise
            time.sleep(0.05 * (attempt + 1))


def add_missing_columns(engine: Engine) -> list[str]:
    """The one migration rule: a column added to a table here after a DB file was created is added
    to that DB (``ALTER TABLE … ADD COLUMN``, nullable, no default), so an existing log DB keeps
    working and old rows read NULL. ``create_all`` only creates missing *tables*. Several processes
    may open the same DB at once: a column another one added meanwhile is not an error.
    Returns the ``table.column`` names added."""
    added = []
    for table in metadata.sorted_tables:
        have = {c["name"] for c in inspect(engine).get_columns(table.name)}
        for col in table.columns:
            if col.name in have:
                continue
            if not col.nullable or col.primary_key:
                raise RuntimeError(f"{table.name}.{col.name}: only nullable columns can be added to an existing DB")
            ddl = (f"ALTER TABLE {table.name} ADD COLUMN {col.name} "
                   f"{col.type.compile(dialect=engine.dialect)}")
            try:
                with engine.begin() as conn:
                    conn.exec_driver_sql(ddl)
            except DBAPIError:
                if col.name not in {c["name"] for c in inspect(engine).get_columns(table.name)}:
                    raise
            added.append(f"{table.name}.{col.name}")
    return added


UPSERT_DIALECTS = {"sqlite": sqlite_insert, "postgresql": pg_insert}  # those with INSERT ... ON CONFLICT


def _upsert(conn: Connection, table: Table, row: Mapping[str, Any]) -> None:
    """Insert, or update the existing row with the same id: one prepared statement where the
    database has INSERT ... ON CONFLICT (SQLite, PostgreSQL: a worker writes a batch row per group),
    else a look-up first."""
    if conn.dialect.name in UPSERT_DIALECTS:
        conn.execute(_upsert_statement(conn.dialect.name, table.name, tuple(sorted(row))), dict(row))
        return
    found = conn.execute(select(table.c.id).where(table.c.id == row["id"])).first()
    if found:
        conn.execute(update(table).where(table.c.id == row["id"]).values(**row))
    else:
        conn.execute(table.insert().values(**row))


@lru_cache(maxsize=32)
def _upsert_statement(dialect: str, table_name: str, columns: tuple[str, ...]):
    """The upsert of ``columns`` into a table (built once per column set, as ``_settle_statement``)."""
    table = metadata.tables[table_name]
    stmt = UPSERT_DIALECTS[dialect](table).values({c: bindparam(c) for c in columns})
    return stmt.on_conflict_do_update(index_elements=[table.c.id],
                                      set_={c: stmt.excluded[c] for c in columns if c != "id"})


def record_request(engine: Engine, row: Mapping[str, Any]) -> None:
    with engine.begin() as conn:
        _upsert(conn, requests, {"created": time.time(), **row})


def record_requests(engine: Engine, rows: list[Mapping[str, Any]]) -> None:
    """New request rows (one admission: n choices, prompt lists) in one transaction."""
    with engine.begin() as conn:
        conn.execute(requests.insert(), [{"created": time.time(), **row} for row in rows])


OPEN = "queued"  # the one status a record is settled from


def finish_request(engine: Engine, request_id: str, *, overrule: bool = False, **values: Any) -> bool:
    """Settle a request's record (its final status and measurements). A record is settled once,
    from ``queued``: the first owner to settle it wins, and a later writer changes nothing (a
    worker finishing a row the gateway has already withdrawn, a re-run of an answered row).
    ``overrule``: the gateway's withdrawal (``timeout``, ``cancelled``) replaces whatever was
    written, because it is what the client saw — even when the worker finished the row in the
    same instant. Returns whether the record changed."""
    return bool(finish_requests(engine, [(request_id, values)], overrule=overrule))


def finish_requests(engine: Engine, settlements: list[tuple[str, Mapping[str, Any]]], *,
                    overrule: bool = False, batch_rows: Sequence[Mapping[str, Any]] = ()) -> int:
    """Settle several records (``finish_request``'s rule) in one transaction: a worker step that
    answers rows of many batches pays for one commit, not one per row. Consecutive settlements
    that set the same columns go as one prepared statement with many parameter sets: building and
    compiling an UPDATE per row was a tenth of an upstream worker's CPU. ``batch_rows``: batch runs
    that ended with these rows, recorded in the same transaction (``record_batches``). Returns how
    many records changed."""
    if not settlements and not batch_rows:
        return 0
    now = time.time()
    runs: list[tuple[tuple[str, ...], list[dict[str, Any]]]] = []
    for request_id, values in settlements:
        vals = {"finished": now, **values}
        columns = tuple(sorted(vals))
        params = {"_id": request_id, **{f"_v_{k}": v for k, v in vals.items()}}
        if runs and runs[-1][0] == columns:
            runs[-1][1].append(params)
        else:
            runs.append((columns, [params]))
    changed = 0
    with engine.begin() as conn:
        for columns, params in runs:
            res = conn.execute(_settle_statement(columns, overrule), params if len(params) > 1 else params[0])
            changed += max(0, int(res.rowcount or 0))
        for row in batch_rows:
            _upsert(conn, batches, row)
    return changed


@lru_cache(maxsize=64)
def _settle_statement(columns: tuple[str, ...], overrule: bool):
    """The UPDATE that settles a record's ``columns`` (built once per column set)."""
    q = update(requests).where(requests.c.id == bindparam("_id"))
    if not overrule:
        q = q.where(requests.c.status == OPEN)
    return q.values({c: bindparam(f"_v_{c}") for c in columns})


def settled_ids(engine: Engine, request_ids: list[str]) -> set[str]:
    """Which of these requests have a settled record (answered or failed explicitly): the
    worker settles a row's record before it publishes the answer, so these must never run again,
    even when their stream has already expired."""
    if not request_ids:
        return set()
    q = select(requests.c.id).where(requests.c.id.in_(request_ids), requests.c.status != OPEN)
    with engine.connect() as conn:
        return {r[0] for r in conn.execute(q)}


def fail_stale_queued(engine: Engine, created_before: float, error: str) -> int:
    """Rows still ``queued`` that no client can be waiting for any more (older than the
    gateway's timeout): lost before they were scheduled, e.g. in a Redis restart without
    persistence. They become ``failed`` so no record stays open forever. Returns how many."""
    with engine.begin() as conn:
        res = conn.execute(update(requests).where(requests.c.status == "queued", requests.c.created < created_before)
                           .values(status="failed", error=error, finished=time.time()))
        return int(res.rowcount or 0)


def record_batch(engine: Engine, row: Mapping[str, Any]) -> None:
    record_batches(engine, [row])


def record_batches(engine: Engine, rows: list[Mapping[str, Any]]) -> None:
    """Batch rows (insert, or update the row with the same id) in one transaction."""
    finish_requests(engine, [], batch_rows=rows)


def finished_requests(engine: Engine, since: float = 0.0, limit: int | None = None) -> list[dict[str, Any]]:
    """Completed requests (with actual lengths) finished after ``since``, oldest first."""
    q = (select(requests).where(requests.c.status == "done", requests.c.finished > since)
         .order_by(requests.c.finished))
    if limit:
        q = q.limit(limit)
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(q)]


def finished_batches(engine: Engine, since: float = 0.0, include_oom: bool = False) -> list[dict[str, Any]]:
    """Batch runs finished after ``since`` (OOM runs excluded unless asked: their time is not a batch time)."""
    q = select(batches).where(batches.c.finished > since)
    if not include_oom:
        q = q.where(batches.c.oom.is_(False))
    with engine.connect() as conn:
        return [dict(r._mapping) for r in conn.execute(q.order_by(batches.c.finished))]



# --- retention ------------------------------------------------------------------------
SETTLED = ("done", "failed", "cancelled", "timeout")


PRUNE_CHUNK = 2000  # rows per transaction: the write lock is held for milliseconds at a time


def _chunked(engine: Engine, table: Table, cond, values: dict[str, Any] | None = None) -> int:
    """Delete (or, with ``values``, update) the rows matching ``cond`` in transactions of
    ``PRUNE_CHUNK`` rows, so the writers of the request path never wait long on SQLite's one
    write lock (the caller may be a low-priority process that the CPU cap stops mid-second)."""
    total = 0
    while True:
        ids = select(table.c.id).where(cond).limit(PRUNE_CHUNK).scalar_subquery()
        q = update(table).values(**values) if values else table.delete()
        with engine.begin() as conn:
            n = conn.execute(q.where(table.c.id.in_(ids))).rowcount or 0
        total += n
        if n < PRUNE_CHUNK:
            return total


def prune_log(engine: Engine, now: float, max_age_s: float, max_rows: int, prompt_age_s: float) -> dict[str, int]:
    """Bound the log DB: delete settled request rows (and batch rows) older than ``max_age_s``,
    then the oldest settled rows beyond ``max_rows`` per table, and blank the prompts of requests
    settled more than ``prompt_age_s`` ago (their lengths, times and status stay: what the
    estimator and the metrics need). Open (``queued``) rows are never touched. Returns counts."""
    cutoff, prompt_cut = now - max_age_s, now - prompt_age_s
    settled = requests.c.status.in_(SETTLED)
    ran = batches.c.finished.is_not(None)
    out = {"requests_aged": _chunked(engine, requests, settled & (requests.c.finished < cutoff)),
           "batches_aged": _chunked(engine, batches, ran & (batches.c.finished < cutoff))}
    for name, table, cond in (("requests_over", requests, settled), ("batches_over", batches, ran)):
        # the newest max_rows rows are kept; the finished time of the row just past them is the cut
        with engine.connect() as conn:
            edge = conn.execute(select(table.c.finished).where(cond).order_by(table.c.finished.desc())
                                .offset(max_rows).limit(1)).scalar()
        out[name] = 0 if edge is None else _chunked(engine, table, cond & (table.c.finished <= edge))
    has_prompt = requests.c.instruction.is_not(None) | requests.c.user_input.is_not(None)
    out["prompts_dropped"] = _chunked(engine, requests, settled & (requests.c.finished < prompt_cut) & has_prompt,
                                      {"instruction": None, "user_input": None})
    return out

def log_counts(engine: Engine) -> dict[str, int]:
    """Rows per table, and how many request rows still hold a prompt (what retention bounds)."""
    with engine.connect() as conn:
        return {"requests": int(conn.execute(select(func.count()).select_from(requests)).scalar() or 0),
                "batches": int(conn.execute(select(func.count()).select_from(batches)).scalar() or 0),
                "prompts": int(conn.execute(select(func.count()).select_from(requests).where(
                    requests.c.instruction.is_not(None) | requests.c.user_input.is_not(None))).scalar() or 0)}
