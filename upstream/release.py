"""The upstream worker's side of direct streaming (COHORT_UPSTREAM_STREAMING=gateway): a row whose
gateway streams it from the engine itself (``ProfiledRequest.owner``) is *released* to that gateway
when its group joins the engine's rows, instead of streamed here.

The worker keeps deciding: admission under the engine's KV, the priority the engine gets, a row
whose stream broke (back to the batcher as a continuation from the ids its gateway reported, on
another instance while this engine is down), a row whose gateway died (failed: nobody reads it).
What crosses is metadata: one ``protocol.Release`` per row run, a few batched ``StreamReport``s
back. Rows that ask for logprobs, and servers that stream text without token ids, stay streamed
here (a continuation must resume from exact ids).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from cohort import bus
from cohort.protocol import FinishReason, Release, ReportKind, StreamReport
from cohort.release_bus import gateway_alive_key, gateway_inbox, instance_inbox, push_in_order, serve_inbox
from upstream.rows import AdmissionGroup, ReportPace, Row
from workers.step_outputs import RowResult

log = logging.getLogger(__name__)
SILENCE_MARGIN_S = 10.0  # beyond the server's read timeout, before a released row nothing was heard of is handed back


class ReleaseLink:
    """The worker's Redis side of releases: its outbox to gateways and its inbox of reports. Used on
    the upstream loop's own asyncio thread (``start`` runs there)."""

    def __init__(self, redis_url: str, instance: str, admitted: Callable[[Any, list[str]], None] | None = None) -> None:
        self.redis_url, self.instance = redis_url, instance
        self.redis: Any = None
        self.admitted = admitted  # queues the admission news of batches on a pipeline (``workers.reporting``)
        self._out: dict[str, list[str]] = {}
        self._marks: list[str] = []
        self._flushing = False

    async def start(self, on_reports) -> None:
        self.redis = bus.connect_async(self.redis_url, max_connections=16)
        asyncio.get_running_loop().create_task(self._read(on_reports))

    def send(self, owner: str, rel: Release) -> None:
        self._out.setdefault(owner, []).append(rel.to_json())
        self._flush_soon()

    def mark_admitted(self, batch_id: str) -> bool:
        """Tell the batcher, with this turn's releases, that a group's rows run: a group whose rows
        all went to gateways has nothing else to publish then, and a round of the worker's publisher
        (a thread hand-over and a pipeline) for that news alone cost more than the releases' push.
        False when this link does not carry admissions (the publisher tells it)."""
        if self.admitted is None:
            return False
        self._marks.append(batch_id)
        self._flush_soon()
        return True

    def _flush_soon(self) -> None:
        if not self._flushing:  # every release and admission of this turn of the loop goes in one pipeline
            self._flushing = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._flush()))

    async def _flush(self) -> None:
        """Push the waiting releases until none wait, in order (``push_in_order``): a gateway that
        took a row's release after its re-release (the continuation) would run the stale one. The
        admissions go with the first push, and again with each retry until one went through."""
        try:
            while self._out or self._marks:
                marks, self._marks = self._marks, []
                also = partial(self.admitted, batch_ids=marks) if marks else None  # marks only where ``admitted`` is set
                await push_in_order(self.redis, self._out, gateway_inbox, lambda releases: releases, "release(s)",
                                    also=also)
        finally:
            self._flushing = False

    async def _read(self, on_reports) -> None:
        await serve_inbox(self.redis.client(), instance_inbox(self.instance),
                          lambda js: on_reports([StreamReport.from_dict(d) for d in json.loads(js)]), "stream reports")

    async def dead(self, owners: set[str]) -> set[str]:
        """The gateways among ``owners`` that stopped heart-beating."""
        if not owners:
            return set()
        names = sorted(owners)
        pipe = self.redis.pipeline(transaction=False)
        for owner in names:
            pipe.exists(gateway_alive_key(owner))
        return {o for o, hit in zip(names, await pipe.execute(), strict=True) if not hit}


class Releasing:
    """What ``upstream.admission.UpstreamLoop`` does with released rows (a mixin: it owns the
    rows, the server and the thread; this is the part of its job that talks to gateways)."""

    link: ReleaseLink | None
    pace: ReportPace

    def _releases(self, row: Row) -> bool:
        s = row.req.sampling
        return (self.link is not None and row.req.owner is not None and self.server.caps.token_ids
                and s.logprobs is None and s.prompt_logprobs is None)

    def _release(self, row: Row, priority: int | None) -> None:
        req = row.req
        row.released, row.heard_at = True, time.monotonic()
        body = self.server.body(req, self._prompt(row), row.limit, priority)
        self.link.send(req.owner, Release(
            req.id, self.link.instance, self.server.base_url, self.server.payload(body), done_tokens=req.done_tokens,
            stop=list(req.sampling.stop or ()), limit=row.limit, max_tokens=req.max_tokens,
            batch_id=row.group.batch.id, batch_size=row.group.batch.size, arrival=req.arrival, started=time.time()))

    def _told_with_releases(self, g: AdmissionGroup) -> bool:
        """A group whose rows all went to gateways: its admission goes to the batcher with their
        releases (``ReleaseLink.mark_admitted``), not in a round of the publisher."""
        if self.link is None or not any(r.released for r in g.rows) or any(r.task is not None for r in g.rows):
            return False
        g.told_admitted = self.link.mark_admitted(g.batch.id)
        return g.told_admitted

    def _held(self, rows: list[Row]) -> list[int]:
        """The KV each row may hold on the server (``Row.held_context``): what arrived, plus what a
        chunked stream has not sent yet, plus what a released row streamed since its last report."""
        unsent, now = self.server.chunk_tokens - 1, time.monotonic()
        return [r.held_context(unsent + self.pace.unreported(r, now)) for r in rows]

    def on_reports(self, reports: list[StreamReport]) -> None:
        """A batch of reports from a gateway: progress, ends, broken streams, refusals, cancels."""
        for rep in reports:
            row = self._rows.get(rep.request_id)
            if row is None or not row.released or row.ended:
                continue
            now = time.monotonic()
            ids = rep.ids[:max(0, row.limit - len(row.new_ids))]
            if rep.kind is ReportKind.PROGRESS and row.new_ids:  # a row's first report also waited out its prefill
                self.pace.add(len(ids), now - row.heard_at)
            row.heard_at = now
            row.new_ids += ids
            row.group.generated += len(ids)
            row.group.dirty = True
            if row.first_token_at is None and rep.first_token_at is not None:
                row.first_token_at = rep.first_token_at
            if rep.kind is ReportKind.FINISH:
                row.group.out.finished.append(RowResult(
                    row.req, "", row.req.done_tokens + len(row.new_ids), FinishReason(rep.finish_reason or "stop"),
                    row.first_token_at, time.time(), rep.cached_tokens, relayed=False))
                row.ended = True
                self._row_ended(row)
            elif rep.kind is ReportKind.CANCELLED:
                row.ended = True
                self._row_ended(row)
            elif rep.kind is ReportKind.REFUSED:
                self._fail(row, f"the upstream server refused this request: {rep.error}")
            elif rep.kind is ReportKind.BROKEN:
                self._aloop.create_task(self._broken(row, rep.error or "its stream broke"))
        self._schedule_flush()

    async def _broken(self, row: Row, error: str) -> None:
        """A stream its gateway saw break: a server whose /health does not answer is down (its other
        rows' streams break too); the row continues elsewhere from the ids reported."""
        if not await self.server.healthy():
            self._mark_down(error)
        self._evict(row)

    async def _check_owners(self) -> None:
        """Rows whose gateway stopped heart-beating fail: their client went with it. A row nothing
        was heard of for longer than its gateway's stream could be silent (the server's read timeout,
        and a margin) continues elsewhere: its release or its reports were lost (Redis restarted)."""
        released = [r for r in self._rows.values() if r.released and not r.ended]
        if not released or self.link is None:
            return
        silent = time.monotonic() - self.server.timeout_s - SILENCE_MARGIN_S
        for row in [r for r in released if r.heard_at < silent]:
            log.warning("row %s: no word from its gateway for %.0f s; it continues elsewhere", row.req.id,
                        time.monotonic() - row.heard_at)
            self._evict(row)
        owners = {r.req.owner for r in released if not r.ended}
        with contextlib.suppress(Exception):  # Redis gone: asked again at the next watch
            for gone in await self.link.dead(owners):
                for row in [r for r in self._rows.values() if r.released and r.req.owner == gone]:
                    self._fail(row, "the gateway streaming it went away (its client's connection with it)")
