"""The job runner: carries Batch API jobs from ``validating`` to a final status.

Why a process of its own that calls the gateway: a job's rows must take the same path as any
request — validation, the pool's tokenizer, the predictor, admission, the batcher's policy and
memory plan — so each row is an ordinary request to the gateway's endpoint, sent at a background
``priority`` (``COHORT_OFFLINE__PRIORITY``, lower is served earlier and the batcher is strict
across levels): the rows fill the capacity interactive traffic leaves and give way to it. The
runner keeps at most ``COHORT_OFFLINE__MAX_OUTSTANDING`` rows in flight (all jobs together, shared
round-robin), enough for the batcher to plan large batches, few enough that the queue stays
short for interactive requests. Past ``COHORT_OFFLINE__URGENT_AFTER`` of its window a job's new
rows rise linearly to priority 0 (reached at 90 % of the window); a job still unfinished when
its window closes expires as OpenAI's do: rows without an answer go to the error file
(``batch_expired``), finished ones are kept.

Durable: every row's state is in the log DB (cohort.jobdb). A row is ``running`` while sent; a
transient failure (the gateway restarting, a full queue, a lost worker, a shed row) puts it back
to ``pending`` and it is sent again; its answer is written by one guarded update, so it is
answered once, whatever crashed. A runner that starts finds rows a previous one left running and
sends them again (their earlier answers, if any, were never written). Each attempt's request has
an id fixed by the row (``cohort.apikeys.row_request_id``); a row sent again after its answer was
lost (a gateway restart, a runner restart) keeps its attempt, so the gateway re-attaches it to the
request still in the system instead of running it twice (``gateway.reattach``). Redis holds none
of this.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any

import httpx

from cohort import bus, jobdb
from cohort.apikeys import (
    INTERACTIVE_SEEN_KEY,
    ROW_REQUEST_HEADER,
    RUNNER_HEADER,
    row_request_id,
    runner_secret,
)
from cohort.filestore import FileStore
from cohort.settings import Settings
from offline.lines import DONE, RETRY, error_line, outcome, parse_input, response_line

log = logging.getLogger("cohort.offline")

URGENT_AT = 0.9  # fraction of the window at which a job's rows reach priority 0
BACKOFF_S = 1.0  # the first wait before a row is sent again; doubled each attempt, up to MAX_BACKOFF_S
MAX_BACKOFF_S = 30.0
GATEWAY_WAIT_S = 2.0  # a gateway that did not answer: no row is sent for this long


def row_priority(s: Settings, now: float, started: float, expires: float) -> int:
    """A job's rows start at COHORT_OFFLINE__PRIORITY and rise to 0 as the window closes."""
    frac = (now - started) / max(1.0, expires - started)
    lo = s.offline.urgent_after
    if frac <= lo or s.offline.priority <= 0:
        return s.offline.priority
    if frac >= URGENT_AT or lo >= URGENT_AT:
        return 0
    return round(s.offline.priority * (URGENT_AT - frac) / (URGENT_AT - lo))


class JobRunner:
    def __init__(self, s: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.s = s
        self.db = jobdb.jobs_engine(s.database_url)
        self.store = FileStore(s.resolved_files_dir)
        url = s.offline.gateway_url or f"http://{s.host}:{s.port}"
        self.client = client or httpx.AsyncClient(base_url=url, timeout=s.request_timeout_s + 30)
        self.secret = runner_secret(s.data_dir)
        self.tasks: dict[str, dict[str, asyncio.Task]] = {}  # batch id -> row id -> its sending task
        self._turn = 0
        self._paused_until = 0.0  # the gateway did not answer: wait before sending more
        self.redis = bus.connect_async(s.redis_url) if s.redis_url else None  # only for the interactive hint

    async def in_flight_limit(self) -> int:
        """COHORT_OFFLINE__MAX_OUTSTANDING, or COHORT_OFFLINE__YIELD_OUTSTANDING while interactive
        requests arrive: a running batch cannot be interrupted, so while interactive traffic is
        there the background rows go in small batches that finish soon."""
        s = self.s
        if self.redis is None or s.offline.yield_s <= 0:
            return s.offline.max_outstanding
        try:
            seen = float(await self.redis.get(INTERACTIVE_SEEN_KEY) or 0)
        except Exception:  # Redis away: the gateway will refuse rows anyway; no hint
            return s.offline.max_outstanding
        recent = time.time() - seen < s.offline.yield_s
        return min(s.offline.yield_outstanding, s.offline.max_outstanding) if recent else s.offline.max_outstanding

    async def run(self, stop: asyncio.Event | None = None) -> None:
        stop = stop or asyncio.Event()
        n = await asyncio.to_thread(jobdb.release_all_running, self.db)
        if n:
            log.info("%d rows a previous runner left in flight are sent again (re-attached where their "
                     "requests still run)", n)
        log.info("job runner ready: rows go to %s, at most %d in flight, priority %d", self.client.base_url,
                 self.s.offline.max_outstanding, self.s.offline.priority)
        try:
            while not stop.is_set():
                try:
                    await self.step()
                except Exception:  # the log DB away for a moment: try again next round
                    log.exception("job runner step failed")
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.s.offline.poll_s)
        finally:
            for rows in self.tasks.values():
                for t in rows.values():
                    t.cancel()
            await self.client.aclose()
            if self.redis is not None:
                await self.redis.aclose()

    async def step(self) -> None:
        """One round: validate new jobs, stop cancelled and expired ones, finish done ones, send rows."""
        now = time.time()
        for b in await asyncio.to_thread(jobdb.batches_in, self.db, ("validating",)):
            await asyncio.to_thread(self.validate, b)
        for b in await asyncio.to_thread(jobdb.batches_in, self.db, ("cancelling",)):
            await self._stop_rows(b["id"])
            await asyncio.to_thread(self.close, b, "batch_cancelled", "the batch was cancelled before this request "
                                    "ran", "cancelled")
        for b in await asyncio.to_thread(jobdb.batches_in, self.db, ("finalizing",)):  # a runner died finalizing
            await asyncio.to_thread(self.finalize, b, "completed")
        live = []
        for b in await asyncio.to_thread(jobdb.batches_in, self.db, ("in_progress",)):
            if b["expires_at"] and now >= b["expires_at"]:
                await self._stop_rows(b["id"])
                await asyncio.to_thread(self.close, b, "batch_expired", "the batch's completion window passed "
                                        "before this request ran", "expired")
                continue
            counts = await asyncio.to_thread(jobdb.row_counts, self.db, b["id"])
            if not counts.get(jobdb.ROW_PENDING) and not counts.get(jobdb.ROW_RUNNING) and not self.tasks.get(b["id"]):
                await asyncio.to_thread(self.finalize, b, "completed")
                continue
            live.append(b)
        await self._fill(live)

    def validate(self, b: dict[str, Any]) -> None:
        """Read the input file into rows (bad lines become error rows), or fail the job."""
        now = int(time.time())
        try:
            text = self.store.read(b["input_file_id"]).decode("utf-8")
        except (FileNotFoundError, UnicodeDecodeError, ValueError) as e:
            self._fail(b, "invalid_file", f"the input file {b['input_file_id']} cannot be read: {e}")
            return
        parsed = parse_input(text, b["id"], (b["endpoint"],), self.s.batch_max_rows)
        if parsed.fatal:
            self._fail(b, "not_a_batch_file", parsed.fatal)
            return
        if not jobdb.row_counts(self.db, b["id"]):  # a runner that died validating inserted nothing or all
            jobdb.insert_rows(self.db, b["id"], parsed.rows + parsed.errors)
        total = len(parsed.rows) + len(parsed.errors)
        jobdb.set_batch(self.db, b["id"], from_status=("validating",), status="in_progress", in_progress_at=now,
                        total=total)
        log.info("batch %s: %d requests (%d invalid) in progress", b["id"], total, len(parsed.errors))

    def _fail(self, b: dict[str, Any], code: str, message: str) -> None:
        errors = [{"code": code, "message": message, "param": "input_file_id", "line": None}]
        jobdb.set_batch(self.db, b["id"], from_status=("validating",), status="failed", failed_at=int(time.time()),
                        errors=json.dumps(errors))
        log.warning("batch %s failed validation: %s", b["id"], message)

    def close(self, b: dict[str, Any], code: str, message: str, final: str) -> None:
        """Cancelled or expired: rows without an answer get an error line; the files are written."""
        jobdb.close_open_rows(self.db, b["id"], lambda r: error_line(b["id"], r["idx"], r["custom_id"], code, message))
        self.finalize(b, final)

    def finalize(self, b: dict[str, Any], final: str) -> None:
        """Write the output and error files (ids fixed by the job: writing again replaces them) and
        set the final status."""
        now = int(time.time())
        if final == "completed":
            jobdb.set_batch(self.db, b["id"], from_status=("in_progress",), status="finalizing", finalizing_at=now)
        ids = {}
        for status, kind in ((jobdb.ROW_DONE, "output"), (jobdb.ROW_ERROR, "error")):
            lines = jobdb.settled_lines(self.db, b["id"], status)
            if not lines:
                continue
            fid = f"file-{b['id'].removeprefix('batch-')}-{kind}"
            data = ("\n".join(lines) + "\n").encode()
            self.store.write(fid, data)
            if jobdb.get_file(self.db, fid, None) is None:
                jobdb.add_file(self.db, {"id": fid, "owner": b["owner"], "created_at": now, "bytes": len(data),
                                         "filename": f"{b['id']}_{kind}.jsonl", "purpose": "batch_output"})
            ids[f"{kind}_file_id"] = fid
        counts = jobdb.row_counts(self.db, b["id"])
        stamp = {"completed": "completed_at", "cancelled": "cancelled_at", "expired": "expired_at"}[final]
        jobdb.set_batch(self.db, b["id"], status=final, **{stamp: now}, **ids,
                        completed=counts.get(jobdb.ROW_DONE, 0), failed=counts.get(jobdb.ROW_ERROR, 0))
        log.info("batch %s %s: %d answered, %d errors", b["id"], final, counts.get(jobdb.ROW_DONE, 0),
                 counts.get(jobdb.ROW_ERROR, 0))

    async def _stop_rows(self, batch_id: str) -> None:
        tasks = list(self.tasks.pop(batch_id, {}).values())
        for t in tasks:
            t.cancel()  # the HTTP request closes: the gateway withdraws the row from the queue and the batch
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _fill(self, live: list[dict[str, Any]]) -> None:
        """Send pending rows while fewer than the limit are in flight, the jobs taking turns."""
        if not live or time.monotonic() < self._paused_until:
            return
        free = await self.in_flight_limit() - sum(len(t) for t in self.tasks.values())
        if free <= 0:
            return
        self._turn = (self._turn + 1) % len(live)
        order = live[self._turn:] + live[:self._turn]
        share = max(1, free // len(order))
        for b in order:
            if free <= 0:
                break
            rows = await asyncio.to_thread(jobdb.claim_rows, self.db, b["id"], min(share, free))
            prio = row_priority(self.s, time.time(), float(b["in_progress_at"] or b["created_at"]), float(b["expires_at"]))
            for r in rows:
                self.tasks.setdefault(b["id"], {})[r["id"]] = asyncio.create_task(self._send(b, r, prio))
            free -= len(rows)

    async def _send(self, b: dict[str, Any], r: dict[str, Any], priority: int) -> None:
        try:
            await self._send_once(b, r, priority)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s row %s: unexpected error; it will be sent again", b["id"], r["idx"])
            await asyncio.to_thread(jobdb.release_row, self.db, r["id"])
        finally:
            self.tasks.get(b["id"], {}).pop(r["id"], None)

    async def _send_once(self, b: dict[str, Any], r: dict[str, Any], priority: int) -> None:
        body = {**json.loads(r["body"]), "priority": priority}
        headers = {"authorization": f"Bearer {self.secret}", RUNNER_HEADER: b["owner"],
                   ROW_REQUEST_HEADER: row_request_id(r["id"], r["attempts"])}
        try:
            resp = await self.client.post(b["endpoint"], json=body, headers=headers)
        except httpx.HTTPError as e:  # the gateway is down or restarting: no attempt spent, wait for it
            log.warning("batch %s row %s: the gateway did not answer (%s); sent again later", b["id"], r["idx"], e)
            self._paused_until = time.monotonic() + GATEWAY_WAIT_S
            await asyncio.sleep(GATEWAY_WAIT_S)
            await asyncio.to_thread(jobdb.release_row, self.db, r["id"], True)
            return
        (kind, answer), status, rid = outcome(resp), resp.status_code, resp.headers.get("x-request-id")
        if kind == RETRY and r["attempts"] < self.s.offline.max_attempts:
            await asyncio.sleep(min(MAX_BACKOFF_S, BACKOFF_S * 2 ** (r["attempts"] - 1)))
            await asyncio.to_thread(jobdb.release_row, self.db, r["id"])
            return
        line = response_line(b["id"], r["idx"], r["custom_id"], status, rid, answer)
        await asyncio.to_thread(jobdb.settle_row, self.db, r["id"], jobdb.ROW_DONE if kind == DONE else jobdb.ROW_ERROR,
                                line)
