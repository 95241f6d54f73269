"""An upstream instance's engine loop: the admission groups the batcher sends run as streaming
completions on an OpenAI-compatible server (``upstream.api``), on one asyncio thread.

It has the continuous loop's face (``submit``, ``updates``, ``cancel``), so the instance's one
publisher (``workers.group_publisher``) reports for it unchanged: the same Redis streams, log-DB
rows, metrics and completions as the built-in engine. What differs is who decodes:

* **Admission.** Groups wait in the order the batcher sent them (the policy's order) and join
  while the running rows plus the group fit the server's KV capacity by the one running-set rule
  (``batcher.kv_judge.KVJudge.running_set_fits``: contexts, with tokens the server holds unsent,
  less prompt pages rows share (held once by the server's prefix cache), and planned remaining
  tokens, past the server's KV by as far as plans have reached past what rows generated, up to
  ``overcommit`` (``upstream.rows.PlanReach``): the server's own queue and preemption absorb the
  rest) and while the server reports no queue of its own (vLLM's ``num_requests_waiting``, SGLang's
  ``num_queue_reqs``; looked at again as soon as a group is held by it). An empty instance takes any
  group. While one waits, the instance takes no other group off the pool's set (``take_wait_s``).
* **Order.** Each row carries ``priority`` = its client priority, then its group's admission
  number, where the server takes one (vLLM, SGLang: ``upstream.api``).
* **Failure.** A stream that breaks, times out or answers 5xx goes back to the batcher as a
  continuation from the tokens it streamed (another instance of the pool resumes it). When the
  server's /health does not answer either, the server is down: every unfinished row goes back,
  waiting groups go back whole, and the instance stops heart-beating until /health answers again.
  A 4xx fails that row with the server's reason.
* **Cancel.** A row the client left (or a stop string ended) has its stream closed: vLLM aborts it.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from batcher.kv_judge import KVJudge
from cohort.event_loops import new_event_loop
from cohort.protocol import FailureCode, FinishReason
from cohort.types import Batch
from upstream.api import (
    UpstreamServer,
    block_tokens_from_metrics,
    finish_reason,
    kv_tokens_from_metrics,
    queue_from_metrics,
)
from upstream.chunks import Chunk, UpstreamDown, UpstreamRefused
from upstream.group_intake import Room, TakesGroups
from upstream.release import ReleaseLink, Releasing
from upstream.rows import AdmissionGroup, PlanReach, ReportPace, Row, shared_tokens
from workers.continuous_loop import GroupHandle, GroupUpdate, Update, drain
from workers.row_text import TextStage
from workers.step_outputs import StepOutput, TokenEvent

log = logging.getLogger(__name__)
PRIORITY_SPAN = 1_000_000_000  # admission ranks within one client priority
GROUP_SPAN = 1_000             # ranks within one group (its rows, shortest predicted first)
QUEUE_POLL_S = 0.1             # the watch's period while the server's own queue holds groups back


class UpstreamLoop(Releasing, TakesGroups):
    """Owns the asyncio thread, the server client and the groups it runs (``link``: releases rows
    to the gateways that stream them, ``upstream.release``)."""

    def __init__(self, server: UpstreamServer, tokenizer, capacity_tokens: int, *, page_tokens: int = 16,
                 max_rows: int = 256, use_priority: bool = True, poll_s: float = 2.0, flush_s: float = 0.02,
                 overcommit: float = 0.0, take_wait_s: float = 0.0, link: ReleaseLink | None = None) -> None:
        self.server, self.tok, self.link = server, tokenizer, link
        self.capacity_tokens, self.page_tokens, self.max_rows = capacity_tokens, page_tokens, max_rows
        self.use_priority, self.poll_s, self.flush_s = use_priority, poll_s, flush_s
        self.overcommit, self.take_wait_s = overcommit, take_wait_s  # overcommit: the most ``reach`` may grant
        self.reach, self.pace = PlanReach(), ReportPace()
        self.down = False
        self.server_waiting = 0.0
        self._submitted = self._taken = 0  # groups handed over (callers' thread) and queued (the loop's)
        self._room = Room()  # set while every group handed over has joined: room for another
        self._wake: asyncio.Event | None = None  # ends the watch's sleep
        self._dozing = False
        self.outbox: queue.Queue[list[Update]] = queue.Queue()
        self._waiting: list[AdmissionGroup] = []
        self._groups: dict[str, AdmissionGroup] = {}
        self._rows: dict[str, Row] = {}
        self._admissions = 0
        self._flush_timer: asyncio.TimerHandle | None = None  # the coalescing flush, when one is due
        self._flush_soon = False  # a flush without delay is queued (a row's first token)
        self._aloop = new_event_loop()  # uvloop where installed
        self._thread = threading.Thread(target=self._run, name="upstream-loop", daemon=True)
        self._thread.start()
        self._call(self._watch())
        if link is not None:
            self._call(link.start(self.on_reports))

    # --- the continuous loop's face (called from other threads) --------------------------------
    def submit(self, batch: Batch, prompt_ids: Sequence[list[int]]) -> GroupHandle:
        """Queue a group for admission. While the server is down the group goes straight back to
        the batcher, and this (Celery) thread waits a moment before taking the next batch, so a
        pool's other instances get it instead of a down one bouncing it. While a group waits here
        for room, the thread waits too (up to ``take_wait_s``): the pool's next group stays on the
        pool's set for an instance with room, instead of queueing behind this one's head group
        (a fleet of KV-bound engines: docs/notes/fleet.md)."""
        handle = GroupHandle(self, batch.id, TextStage(self.tok))
        self._submitted += 1
        self._room.clear()
        self._aloop.call_soon_threadsafe(self._take, batch, list(prompt_ids), handle)
        if self.down:
            time.sleep(1.0)
        elif self.take_wait_s > 0:
            self._room.wait(self.take_wait_s)
        return handle

    def counters(self) -> dict[str, float]:
        """The rows streaming and the groups waiting; the upstream server counts its own prefix
        cache and steps (vLLM's ``vllm:prefix_cache_queries`` / ``_hits``)."""
        return {"rows": len(self._rows), "waiting_groups": len(self._waiting)}

    def updates(self, timeout_s: float) -> list[Update]:
        return drain(self.outbox, timeout_s)

    def cancel(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        self._aloop.call_soon_threadsafe(self._cancel, ids)

    def stop(self) -> None:
        """End every stream and the thread (a warm shutdown drains first: ``GroupPublisher.drain``)."""
        def shutdown() -> None:
            for task in asyncio.all_tasks(self._aloop):
                task.cancel()
            self._aloop.call_soon(self._aloop.stop)

        self._aloop.call_soon_threadsafe(shutdown)
        self._thread.join(timeout=10)

    # --- the asyncio thread ----------------------------------------------------------------------
    def _run(self) -> None:
        asyncio.set_event_loop(self._aloop)
        self._aloop.run_forever()

    def _call(self, coro) -> None:
        self._aloop.call_soon_threadsafe(lambda: self._aloop.create_task(coro))

    def _take(self, batch: Batch, prompt_ids: list[list[int]], handle: GroupHandle) -> None:
        g = AdmissionGroup(batch, handle)
        g.rows = [Row(req, ids, g, first_token_at=req.first_token_at)
                  for req, ids in zip(batch.requests, prompt_ids, strict=True)]
        self._groups[batch.id] = g
        self._waiting.append(g)
        self._taken += 1
        self._admit()

    def _fits(self, g: AdmissionGroup) -> bool:
        running = list(self._rows.values())  # a row leaves ``_rows`` when it ends
        if not running or self.server_waiting > 0:
            return not running
        rows = running + g.rows
        judge = KVJudge(self.capacity_tokens, self.page_tokens, self.max_rows,
                        overcommit=self.reach.overcommit(self.overcommit))
        return judge.running_set_fits(self._held(rows), [r.remaining for r in rows], shared=shared_tokens(rows, self.page_tokens))

    def _admit(self) -> None:
        if self.down:
            for g in self._waiting:
                self._hand_back(g)
            self._waiting.clear()
            self._room.set()
            return
        while self._waiting and self._fits(self._waiting[0]):
            g = self._waiting.pop(0)
            g.admitted_at = time.time()
            self._admissions += 1
            ranked = sorted(g.rows, key=lambda r: r.req.predicted_tokens)
            for rank, row in enumerate(ranked):
                if row.ended:  # cancelled while it waited
                    continue
                self._rows[row.req.id] = row
                if self._releases(row):  # its gateway streams it
                    self._release(row, self._priority(row, rank))
                else:
                    row.task = self._aloop.create_task(self._stream(row, self._priority(row, rank)))
            if not self._told_with_releases(g):  # else the publisher has nothing to say of it yet
                g.dirty = True
                self._schedule_flush()
        if not self._waiting and self._taken >= self._submitted:
            self._room.set()
        elif self._waiting and self.server_waiting > 0 and self._dozing and self._wake is not None:
            self._wake.set()  # held by the server's queue: look at it again now, not a poll_s later

    def _priority(self, row: Row, rank: int) -> int | None:
        """The server's ``priority`` (lower runs first): the client's priority, then the group's
        admission number, then the row's rank in its group by predicted length, so the server sees
        the policy's order between groups and shortest-first within one."""
        if not self.use_priority:
            return None
        order = (self._admissions * GROUP_SPAN + min(rank, GROUP_SPAN - 1)) % PRIORITY_SPAN
        return row.req.priority * PRIORITY_SPAN + order

    def _hand_back(self, g: AdmissionGroup) -> None:
        """A group that never ran goes back to the batcher whole."""
        for row in g.rows:
            row.ended = True
            g.out.evicted.append(row.req)
        g.dirty = True
        self._schedule_flush()

    def _prompt(self, row: Row) -> list[int] | str:
        if self.server.caps.token_ids:
            return [*row.prompt_ids, *row.req.generated_ids]
        if not row.req.generated_ids:
            return row.req.prompt
        return row.req.prompt + self.tok.decode(row.req.generated_ids, skip_special_tokens=True)

    async def _stream(self, row: Row, priority: int | None) -> None:
        req = row.req
        if (req.sampling.logprobs is not None or req.sampling.prompt_logprobs is not None) and not self.server.caps.logprobs:
            self._fail(row, "this pool's upstream server does not return logprobs; ask without logprobs")
            return
        body = self.server.body(req, self._prompt(row), row.limit, priority)
        finish: str | None = None
        try:
            async for ch in self.server.stream(body):
                self._accept(row, ch)
                if ch.finish:
                    finish = ch.finish
            if finish is None:
                raise UpstreamDown("the stream ended without a finish reason")
            self._finish(row, finish)
        except asyncio.CancelledError:  # the client left, a stop string ended it, or the server went down
            if not row.ended:
                row.ended = True
                self._row_ended(row)
            raise
        except UpstreamRefused as e:
            self._fail(row, f"the upstream server refused this request: {e}")
        except UpstreamDown as e:
            # a stream that broke on a server whose /health still answers (a refused or slow connection
            # under load): this row alone goes back; a server that does not answer is down
            if not await self.server.healthy():
                self._mark_down(str(e))
            elif not row.ended:
                log.warning("row %s: its upstream stream failed (%s); it continues elsewhere", req.id, e)
            self._evict(row)
        except Exception as e:  # never leave a row hanging
            log.exception("row %s on the upstream failed", req.id)
            self._fail(row, f"{type(e).__name__}: {e}")

    def _accept(self, row: Row, ch: Chunk) -> None:
        """One streamed piece as token events: one per server id, or one per chunk from a text-only
        server (each of its chunks is one token; its ids are cohort's re-tokenization)."""
        if ch.ids is not None:
            ids, pieces = ch.ids, [ch.text] + [""] * max(0, len(ch.ids) - 1)
        elif ch.text:
            enc = self.tok.encode(ch.text, add_special_tokens=False)
            ids, pieces = [enc[-1] if enc else (self.tok.unk_token_id or 0)], [ch.text]
        else:
            return
        now = time.time()
        g = row.group
        first = row.first_token_at is None
        for i, (tok, piece) in enumerate(zip(ids, pieces, strict=True)):
            if row.ended or len(row.new_ids) >= row.limit:
                return
            row.new_ids.append(tok)
            g.generated += 1
            if row.first_token_at is None:
                row.first_token_at = now
            scored = ch.logprobs[i] if ch.logprobs and i < len(ch.logprobs) else None
            g.out.tokens.append(TokenEvent(row.req, tok, row.req.done_tokens + len(row.new_ids), now,
                                           row.first_token_at, None, scored, piece=piece))
        g.dirty = True
        self._schedule_flush(now=first)

    def _finish(self, row: Row, finish: str) -> None:
        if row.ended:
            return
        reason = FinishReason(finish_reason(finish, len(row.new_ids), row.req.max_tokens, row.req.emulated_tokens))
        row.group.out.tokens.append(TokenEvent(row.req, None, row.req.done_tokens + len(row.new_ids), time.time(),
                                               row.first_token_at, reason))
        row.ended = True
        self._row_ended(row)

    def _fail(self, row: Row, message: str) -> None:
        if row.ended:
            return
        row.group.out.failed.append((row.req, FailureCode.BATCH_FAILED, message))
        row.ended = True
        self._row_ended(row)

    def _evict(self, row: Row) -> None:
        """Back to the batcher from what it streamed (``ProfiledRequest.continuation``)."""
        if row.ended:
            return
        req = row.req if row.req.prompt_ids is not None else replace(row.req, prompt_ids=row.prompt_ids)
        row.group.out.evicted.append(req.continuation(list(row.new_ids), row.first_token_at)
                                     if row.new_ids else req)
        row.ended = row.handed_back = True
        self._row_ended(row)

    def _row_ended(self, row: Row) -> None:
        if self._rows.pop(row.req.id, None) is not None and row.new_ids and not row.handed_back:
            self.reach.add(row)  # it ended here: how far its plan reached past it
        row.group.dirty = True
        self._schedule_flush(now=True)  # its client's answer (and e2e) waits for this news
        self._admit()

    def _cancel(self, ids: list[str]) -> None:
        for rid in ids:
            row = self._rows.get(rid)
            if row is not None and row.task is not None:
                row.task.cancel()
            elif row is not None and row.released and not row.ended:  # its gateway closed its stream
                row.ended = True
                self._row_ended(row)
            for g in self._waiting:  # not yet admitted: it just leaves its group
                for r in g.rows:
                    if r.req.id == rid:
                        r.ended = True
                        g.dirty = True

    def _schedule_flush(self, now: bool = False) -> None:
        """Flush ``flush_s`` after the first news: a row's tokens that arrive meanwhile go out as one
        delta (each hop to the client — Redis, the gateway's relay — costs per delta, not per token).
        ``now``: a row's first token or its end, which go out at once (its client's TTFT or answer
        waits for them), with whatever else is pending."""
        if now:
            if self._flush_timer is not None:
                self._flush_timer.cancel()
                self._flush_timer = None
            if not self._flush_soon:
                self._flush_soon = True
                self._aloop.call_soon(self._flush)
        elif self._flush_timer is None and not self._flush_soon:
            self._flush_timer = self._aloop.call_later(self.flush_s, self._flush)

    def _flush(self) -> None:
        """Everything the groups produced since the last flush, as one bundle for the publisher."""
        # this is the one pending flush: a queued immediate one cancelled the timer, and no timer is set while one is queued
        self._flush_timer, self._flush_soon = None, False
        bundle: list[Update] = []
        for bid, g in list(self._groups.items()):
            if not g.dirty:
                continue
            done = all(r.ended for r in g.rows) and (g.admitted or g not in self._waiting)
            news = g.admitted and not g.told_admitted
            upd = GroupUpdate(g.out, g.alive, g.generated, news, done, admitted_at=g.admitted_at)
            g.told_admitted = g.told_admitted or g.admitted
            g.out, g.dirty = StepOutput(), False
            bundle.append((g.handle, upd))
            if done:
                del self._groups[bid]
        if bundle:
            self.outbox.put(bundle)

    def _mark_down(self, why: str) -> None:
        if not self.down:
            log.warning("upstream %s is down (%s): its rows continue on other instances of the pool",
                        self.server.base_url, why)
            self.down = True
            for row in list(self._rows.values()):
                if row.task is not None and not row.ended:
                    row.task.cancel()
                    self._evict(row)
            self._admit()

    async def _watch(self) -> None:
        """Every ``poll_s``: the server's /health (a server that dies while no row streams is marked
        down here; a down one comes back when it answers), a vLLM server's KV capacity and queue
        from its /metrics; every ``QUEUE_POLL_S`` while the server reports a queue and groups wait
        here behind it (they join as soon as its queue is gone, not up to ``poll_s`` later)."""
        self._wake = asyncio.Event()
        while True:
            held = self.server_waiting > 0 and bool(self._waiting)
            self._dozing = not held  # a long sleep, which a group held by the server's queue cuts short
            timer = self._aloop.call_later(min(self.poll_s, QUEUE_POLL_S) if held else self.poll_s, self._wake.set)
            await self._wake.wait()
            timer.cancel()
            self._wake.clear()
            try:
                await self._check_owners()
                healthy = await self.server.healthy()
                if self.down:
                    if healthy:
                        log.info("upstream %s answers /health again: back in the pool", self.server.base_url)
                        self.down = False
                    continue
                if not healthy:  # died while idle: no stream broke to say so
                    self._mark_down("its /health does not answer")
                    continue
                text = await self.server.metrics()
                if text:
                    cap, block = kv_tokens_from_metrics(text), block_tokens_from_metrics(text)
                    if cap:
                        self.capacity_tokens = cap
                    if block:
                        self.page_tokens = block
                    self.server_waiting = queue_from_metrics(text) or 0.0
                    self._admit()
            except Exception:  # the watch never dies
                log.exception("watching upstream %s failed", self.server.base_url)


