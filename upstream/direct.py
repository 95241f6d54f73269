"""The gateway's side of direct streaming: rows the upstream worker released to this gateway are
streamed from their engine here, over one HTTP connection each, straight to their clients.

The worker still decides (which group joins the engine's rows, in what order, with what priority,
what happens to a row whose stream breaks); this gateway only streams and tells it what happened,
in batches: ``PROGRESS`` (the token ids streamed since the last report, at most every ``report_s``:
the worker only plans its engine's KV with them, and each costs it a publishing round)
and, at once, ``FINISH``, ``BROKEN`` (a stream that broke, went silent past the read timeout or
answered 5xx: the worker re-releases the continuation, to this gateway, on another engine where
this one is down), ``REFUSED`` (4xx: the worker fails the row with the engine's reason) or
``CANCELLED`` (the client left: its stream is closed, which makes vLLM abort the request).

An answer's state outlives one release: a continuation's text goes on from the text already sent,
and stop strings are looked for across the cut (the gateway looks for them itself, since a server
may not apply them: it holds back as many characters as the longest stop string, less one).
Events go to the client's relay through ``deliver`` (the gateway's hub, next to what the batcher
and the worker still publish on the request's stream: failures). Imports only ``cohort``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from cohort.protocol import Release, ReportKind, StreamEvent, StreamKind, StreamReport
from cohort.release_bus import (
    GATEWAY_ALIVE_TTL_S,
    gateway_alive_key,
    gateway_inbox,
    instance_inbox,
    push_in_order,
    serve_inbox,
)
from upstream.api import auth_headers, finish_reason
from upstream.chunks import Chunk, UpstreamDown, UpstreamRefused
from upstream.sse_client import SSEClient

log = logging.getLogger(__name__)
CANCELLED_KEEP_S = 600.0  # a withdrawn request's id is remembered this long (its release may still come)


@dataclass
class _Answer:
    """One request's answer as this gateway streams it, across its releases."""

    rid: str
    tokens: int = 0               # generated so far, earlier runs included
    text: str = ""                # the answer so far (this gateway's runs)
    sent: int = 0                 # characters of ``text`` delivered to the client
    first_token_at: float | None = None
    unreported: list[int] = field(default_factory=list)
    release: Release | None = None
    task: asyncio.Task | None = None
    run_tokens: int = 0           # generated in the current run
    skip: int = 0                 # tokens of a re-run from an earlier point, already sent: not sent again
    cached_tokens: int = 0
    ready: int = 0                # characters of ``text`` that may go out (a possible stop string's start held)


def _encode_reports(reports: list[StreamReport]) -> list[str]:
    """A worker's reports as one message of its inbox (``release_bus.instance_inbox``)."""
    return [json.dumps([r.to_dict() for r in reports], separators=(",", ":"))]


def stop_at(text: str, stops: list[str], start: int) -> int | None:
    """Where the first stop string begins in ``text`` at or after ``start`` (None: none there)."""
    hits = [i for s in stops if s and (i := text.find(s, start)) >= 0]
    return min(hits) if hits else None


class DirectStreams:
    """The releases this gateway takes, the engine streams it runs and the reports it sends."""

    def __init__(self, redis: Any, gateway_id: str, deliver: Callable[[str, list[StreamEvent]], None], *,
                 flush_s: float = 0.05, report_s: float = 0.25, read_timeout_s: float = 60.0,
                 api_key: str | None = None) -> None:
        self.redis, self.gateway_id, self.deliver = redis, gateway_id, deliver
        self.flush_s, self.report_s = flush_s, max(flush_s, report_s)
        self._reported_at = 0.0  # when progress last joined the reports (monotonic)
        self._sse = SSEClient(headers=auth_headers(api_key), read_timeout_s=read_timeout_s)
        self._answers: dict[str, _Answer] = {}
        self._cancelled: dict[str, float] = {}
        self._reports: dict[str, list[StreamReport]] = {}  # by instance: the terminal ones, sent at once
        self._flush_handle: asyncio.Handle | None = None
        self._pushing: asyncio.Task | None = None  # the one push of reports under way
        self._unsent: set[str] = set()  # answers with text ready that waits for the next flush
        self._tasks: list[asyncio.Task] = []

    # --- the gateway's life ----------------------------------------------------------------------
    async def start(self) -> None:
        await self.redis.set(gateway_alive_key(self.gateway_id), "1", ex=GATEWAY_ALIVE_TTL_S)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._inbox()), loop.create_task(self._heartbeat())]

    async def aclose(self) -> None:
        for task in [*self._tasks, *(a.task for a in self._answers.values() if a.task)]:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        with contextlib.suppress(Exception):
            await self._flush()
            await self.redis.delete(gateway_alive_key(self.gateway_id))
        await self._sse.aclose()

    # --- what the relay tells it ----------------------------------------------------------------
    def cancel(self, rid: str) -> None:
        """The client left (or its deadline passed): stop its stream; a later release is refused."""
        now = time.monotonic()
        self._cancelled[rid] = now
        if len(self._cancelled) > 10_000:
            self._cancelled = {k: t for k, t in self._cancelled.items() if now - t < CANCELLED_KEEP_S}
        a = self._answers.pop(rid, None)
        if a is not None and a.release is not None:
            if a.task is not None:
                a.task.cancel()
            self._report(a, ReportKind.CANCELLED)

    def forget(self, rid: str) -> None:
        """The relay is over (answered or failed): nothing of the request is kept."""
        a = self._answers.pop(rid, None)
        if a is not None and a.task is not None and not a.task.done():
            a.task.cancel()

    # --- releases -------------------------------------------------------------------------------
    async def _inbox(self) -> None:
        conn = self.redis.client()
        try:
            await serve_inbox(conn, gateway_inbox(self.gateway_id), lambda js: self._take(Release.from_json(js)),
                              "direct streams' releases")
        finally:
            await conn.aclose(close_connection_pool=False)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(GATEWAY_ALIVE_TTL_S / 3)
            with contextlib.suppress(Exception):
                await self.redis.set(gateway_alive_key(self.gateway_id), "1", ex=GATEWAY_ALIVE_TTL_S)

    def _take(self, rel: Release) -> None:
        a = self._answers.get(rel.request_id)
        if rel.request_id in self._cancelled:
            self._report_to(rel.instance, StreamReport(rel.request_id, ReportKind.CANCELLED))
            return
        if a is None:
            a = self._answers[rel.request_id] = _Answer(rel.request_id, tokens=rel.done_tokens)
        elif a.task is not None and not a.task.done():
            a.task.cancel()  # a re-release while a stream still runs: the worker has moved on from it
        a.skip = max(0, a.tokens - rel.done_tokens)  # a re-run from an earlier point: send nothing twice
        a.tokens = min(a.tokens, rel.done_tokens)
        a.release, a.run_tokens, a.unreported = rel, 0, []
        a.task = asyncio.get_running_loop().create_task(self._run(a, rel))

    # --- one engine stream ----------------------------------------------------------------------
    async def _run(self, a: _Answer, rel: Release) -> None:
        finish: str | None = None

        def take(ch: Chunk) -> bool:  # each piece where its bytes arrive: no task woken per token
            nonlocal finish
            a.cached_tokens = max(a.cached_tokens, ch.cached_tokens)
            if ch.ids and self._accept(a, rel, ch.ids, ch.text):
                finish = "stop"  # a stop string: the stream is closed, which makes vLLM abort the request
                return True
            if ch.finish:
                finish = ch.finish
            return False

        try:
            await self._sse.stream(f"{rel.url.rstrip('/')}/completions", rel.payload, take)
            if finish is None:
                raise UpstreamDown("the stream ended without a finish reason")
            self._end(a, rel, finish)
        except UpstreamRefused as e:
            self._report(a, ReportKind.REFUSED, error=str(e))
        except UpstreamDown as e:
            log.warning("request %s: its stream from %s broke (%s); it continues elsewhere", rel.request_id, rel.url, e)
            self._report(a, ReportKind.BROKEN, error=str(e))
        except Exception as e:  # never leave a row hanging: the worker hands it back
            log.exception("request %s: streaming from %s failed", rel.request_id, rel.url)
            self._report(a, ReportKind.BROKEN, error=f"{type(e).__name__}: {e}")

    def _accept(self, a: _Answer, rel: Release, ids: list[int], text: str) -> bool:
        """A chunk's tokens: counted, reported, their text sent (less a possible stop string's
        start). True when a stop string ended the answer."""
        ids = ids[:max(0, rel.limit - a.run_tokens)] if rel.limit else ids
        if not ids:
            return False
        now = time.time()
        if a.first_token_at is None:
            a.first_token_at = now
        a.run_tokens += len(ids)
        a.tokens += len(ids)
        a.unreported += ids
        if a.skip:
            a.skip = max(0, a.skip - len(ids))
            if a.skip or not text:
                self._schedule_flush()
                return False
        before = len(a.text)
        a.text += text
        longest = max((len(s) for s in rel.stop), default=0)
        cut = stop_at(a.text, rel.stop, max(0, before - longest + 1)) if longest else None
        if cut is not None:
            a.text = a.text[:cut]
            self._send(a, len(a.text))
            return True
        a.ready = len(a.text) - max(0, longest - 1)
        if a.sent == 0:  # the first text goes at once (the client's TTFT waits for it)
            self._send(a, a.ready)
        else:  # the rest as one delta a flush: each costs the relay, the SSE write and the client a round
            self._unsent.add(a.rid)
        self._schedule_flush()
        return False

    def _send(self, a: _Answer, upto: int) -> None:
        if upto > a.sent:
            piece, a.sent = a.text[a.sent:upto], upto
            self.deliver(a.rid, [StreamEvent(StreamKind.DELTA, text=piece, tokens=a.tokens)])

    def _end(self, a: _Answer, rel: Release, engine_reason: str) -> None:
        emulated = rel.limit if rel.limit and rel.limit < rel.max_tokens else None
        reason = engine_reason if engine_reason == "stop" else finish_reason(
            engine_reason, a.run_tokens, rel.max_tokens, emulated)
        self._send(a, len(a.text))
        now = time.time()
        first = a.first_token_at or now
        timings = {"queued_s": max(0.0, rel.started - rel.arrival), "first_token_s": first - rel.arrival,
                   "run_s": now - rel.started, "total_s": now - rel.arrival}
        self.deliver(a.rid, [StreamEvent(StreamKind.END, text=a.text, tokens=a.tokens, finish_reason=reason,
                                         batch_id=rel.batch_id, batch_size=rel.batch_size, timings=timings,
                                         cached_tokens=a.cached_tokens)])
        self._report(a, ReportKind.FINISH, finish_reason=reason)
        self._answers.pop(a.rid, None)

    # --- reports --------------------------------------------------------------------------------
    def _report(self, a: _Answer, kind: ReportKind, **kw: Any) -> None:
        rel = a.release
        if rel is None:
            return
        ids, a.unreported = a.unreported, []
        self._report_to(rel.instance, StreamReport(a.rid, kind, ids=ids,
                                                   first_token_at=a.first_token_at, cached_tokens=a.cached_tokens, **kw))

    def _report_to(self, instance: str, rep: StreamReport) -> None:
        self._reports.setdefault(instance, []).append(rep)
        self._schedule_flush(now=True)  # the worker admits its next group when a row ends

    def _schedule_flush(self, now: bool = False) -> None:
        loop = asyncio.get_running_loop()
        if now:
            if self._flush_handle is not None:
                self._flush_handle.cancel()
            self._flush_handle = loop.call_soon(self._flush_soon)
        elif self._flush_handle is None:
            self._flush_handle = loop.call_later(self.flush_s, self._flush_soon)

    def _flush_soon(self) -> None:
        """Text waiting for its client goes out now; the reports go to their workers one push at a
        time. A push that waits for Redis (its client retries for seconds) must not be overtaken by
        a later one: the worker takes a row's end as final and drops progress that arrives after it,
        so a row's count in the log DB came out short after a Redis restart."""
        self._flush_handle = None
        self._collect()
        if self._reports and self._pushing is None:
            self._pushing = task = asyncio.get_running_loop().create_task(self._push())
            self._tasks.append(task)
            task.add_done_callback(self._tasks.remove)

    def _collect(self, all_progress: bool = False) -> None:
        """The text waiting for its client is sent; every row's progress since the last report joins
        the reports waiting, after them (a row's ids must reach its worker in order), once a
        ``report_s`` (``all_progress``: now). A terminal report carries its row's ids not yet
        reported (``_report``)."""
        unsent, self._unsent = self._unsent, set()
        for rid in unsent:
            if (a := self._answers.get(rid)) is not None:
                self._send(a, a.ready)
        now = time.monotonic()
        if not all_progress and now - self._reported_at < self.report_s:  # every report_s, not every flush
            if any(a.unreported for a in self._answers.values()):
                self._schedule_flush()
            return
        self._reported_at = now
        for a in self._answers.values():
            if a.unreported and a.release is not None:
                ids, a.unreported = a.unreported, []
                self._reports.setdefault(a.release.instance, []).append(StreamReport(
                    a.rid, ReportKind.PROGRESS, ids=ids, first_token_at=a.first_token_at))

    async def _push(self) -> None:
        """Push the waiting reports (one JSON array per worker a push) until none wait, in order
        (``push_in_order``); a failed push is tried again a second later."""
        try:
            await push_in_order(self.redis, self._reports, instance_inbox, _encode_reports,
                                "direct streams' report(s)", pause_s=1.0, max_pause_s=1.0)
        finally:
            self._pushing = None

    async def _flush(self) -> None:
        """Everything waiting, now (the gateway is closing)."""
        self._collect(all_progress=True)
        if self._pushing is None:
            await self._push()
