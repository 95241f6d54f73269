"""Continuous execution's reporter: one thread per worker publishes what every running group's
step produced, in one log-DB transaction and one Redis pipeline per round.

A batch task only claims its batch and hands it over (``submit``); the group then costs no thread
and no Redis round trip of its own. Each round takes every update the engine has made since the
last (``ContinuousLoop.updates``: a publisher that fell behind catches up in one round), sends the
steps together (``reporting.send``: records first, then events, admission markers and cancel
checks), and ends the groups that finished with them: their batch rows in the records' transaction,
their completions in the events' pipeline (a group per request at low load paid a round trip and a
transaction more each). Many small groups (the policy's plan at a small share of Θ) then cost about what
one large batch costs.

A round that cannot be sent (Redis gone past ``reporting.REDIS_OUTAGE_S``, the log DB failing)
fails the groups it carried explicitly, as the padded task fails its batch; a worker that dies
loses its groups the way it loses a padded batch (the batcher resumes the rows from their streams).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cohort import engine_counters
from cohort.protocol import BatchOutcome, CompletionEvent, FailureCode
from cohort.types import Batch
from workers.continuous_loop import ContinuousLoop, Update
from workers.reporting import (
    Fill,
    Outlet,
    Reporter,
    Staged,
    admitted_fill,
    batch_row,
    completion_fill,
    execute,
    send,
)

log = logging.getLogger(__name__)
# The engine's running totals are read by scrapes and soaks, seconds apart: written once a second,
# not every round (a round per report at tens of requests a second)
ENGINE_TOTALS_EVERY_S = 1.0


@dataclass
class _Group:
    batch: Batch
    reporter: Reporter
    submitted: float  # wall time of the hand-over: when the batch started on this instance
    t0: float  # perf_counter then: the batch's time here


class GroupPublisher:
    """Owns the publishing thread and the groups it reports for."""

    def __init__(self, rt: Outlet, loop: ContinuousLoop, wait_s: float = 0.2) -> None:
        self.rt, self.loop, self.wait_s = rt, loop, wait_s
        self.groups: dict[str, _Group] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._counted = (0, 0)  # prefix-cache counters already sent (``_prefix_counts``)
        self._totals_sent = -ENGINE_TOTALS_EVERY_S  # when the engine's totals were last written (monotonic)
        self._thread = threading.Thread(target=self._run, name="group-publisher", daemon=True)
        self._thread.start()

    def submit(self, b: Batch, prompt_ids: Sequence[list[int]]) -> bool:
        """Hand a claimed batch to the engine. False when it already runs here (a redelivery while
        its first copy runs: that copy answers)."""
        if not self.register(b):
            return False
        self.loop.submit(b, prompt_ids)
        return True

    def register(self, b: Batch) -> bool:
        """Report for a claimed batch from now on: registered before the engine can report on it,
        queued until admitted (``started``). False when it already runs here."""
        with self._lock:
            if b.id in self.groups:
                return False
            now = time.time()
            self.groups[b.id] = _Group(b, Reporter(self.rt, b, now, cancel=self.loop.cancel), now, time.perf_counter())
        return True

    def drain(self, timeout_s: float) -> bool:
        """Wait until every group has ended and been reported (a warm shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.groups:
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            updates = self.loop.updates(self.wait_s)
            if not updates:
                continue
            try:
                self._publish(updates)
            except Exception as e:  # never leave a group hanging: fail what this round carried
                log.exception("publishing a round of %d update(s) failed", len(updates))
                self._fail({h.batch_id for h, _ in updates}, f"{type(e).__name__}: {e}")

    def _publish(self, updates: list[Update]) -> None:
        now = time.time()
        last = {h.batch_id: i for i, (h, _) in enumerate(updates)}
        staged: list[Staged] = []
        extra: list[Fill] = []
        done: list[_Group] = []
        failed: dict[str, str] = {}
        steps: dict[str, list[Staged]] = {}  # this round's steps of each group
        for i, (handle, upd) in enumerate(updates):
            g = self.groups.get(handle.batch_id)
            if g is None:  # failed in an earlier round: what the engine made since is dropped
                continue
            if upd.admitted or upd.admitted_at is not None:  # queued until the group joined the running rows
                g.reporter.started = upd.admitted_at or now
            if upd.admitted:  # else its engine loop told the batcher itself (an upstream's released rows)
                extra.append(admitted_fill(self.rt, g.batch.id))
            if upd.error is not None:
                failed[g.batch.id] = upd.error
                continue
            # a group's rows are checked for cancellation once a round, with its latest alive list
            step = g.reporter.stage(upd.out, upd.alive if last[handle.batch_id] == i else [], upd.generated)
            staged.append(step)
            steps.setdefault(g.batch.id, []).append(step)
            if upd.done:
                done.append(g)
        extra.append(self._engine_counts())
        ends, rows = self._ends(done, steps)
        send(self.rt, staged, extra + ends, f"a round of {len(staged)} step(s)", batch_rows=rows)
        if done:
            with self._lock:
                for g in done:
                    self.groups.pop(g.batch.id, None)
        if failed:
            for bid, error in failed.items():
                self._fail({bid}, f"the continuous engine failed: {error}")

    def _engine_counts(self) -> Fill:
        """The engine's counters: its prefix-cache lookups since the last round (the gateway's
        ``cohort_prefix_cache_*_total``) and, once a second, its running totals (``engine_counters.ENGINE_STATS``:
        a soak reads step time and rows per step from them)."""
        c = self.loop.counters()
        queries, hits = int(c.get("prefix_queries", 0)), int(c.get("prefix_hits", 0))
        dq, dh = queries - self._counted[0], hits - self._counted[1]
        self._counted = (queries, hits)
        now = time.monotonic()
        totals = now - self._totals_sent >= ENGINE_TOTALS_EVERY_S
        if totals:
            self._totals_sent = now

        def fill(pipe) -> None:
            engine_counters.count_prefix_cache(pipe, self.rt.name, dq, dh)
            if totals:
                engine_counters.engine_stats(pipe, self.rt.name, c)
        return fill

    def _ends(self, done: list[_Group], steps: dict[str, list[Staged]]) -> tuple[list[Fill], list[dict]]:
        """The groups whose rows are all answered this round: the batcher's completions and the
        batch runs' rows, sent with the round's steps (one transaction, one pipeline for all)."""
        fills, rows = [], []
        finished = time.time()
        for g in done:
            b = g.batch
            answered, tokens, back = g.reporter.ended(steps.get(b.id, []))
            seconds = time.perf_counter() - g.t0
            generated = [tokens.get(r.id, 0) for r in b.requests]
            fills.append(completion_fill(self.rt, CompletionEvent(
                outcome=BatchOutcome.DONE, batch_id=b.id, instance=self.rt.name, size=b.size, started=g.submitted,
                finished=finished, input_len=b.input_len, gen_len=max(generated, default=0), seconds=seconds,
                generated_tokens=generated, answered=answered, continuations=back,
                cancelled=g.reporter.cancelled)))
            rows.append({**batch_row(self.rt, b, g.submitted), "finished": finished,
                         "actual_gen_len": max(generated, default=0), "batch_time_s": seconds, "oom": False})
            if back:
                log.info("batch %s: %d row(s) preempted and handed back with their tokens", b.id, len(back))
        return fills, rows

    def _fail(self, batch_ids: set[str], error: str) -> None:
        """These groups fail explicitly: their rows leave the engine, each unanswered row gets an
        error, the batcher hears the batch failed."""
        for bid in batch_ids:
            with self._lock:
                g = self.groups.pop(bid, None)
            if g is None:
                continue
            rep = g.reporter
            try:
                self.loop.cancel([r.id for r in g.batch.requests])
                rep.fail_rest(FailureCode.BATCH_FAILED, "the worker failed while running this request's batch")
                execute(self.rt.redis, completion_fill(self.rt, CompletionEvent(
                    outcome=BatchOutcome.FAILED, batch_id=bid, instance=self.rt.name, size=g.batch.size,
                    started=g.submitted, error=error, finished=time.time(), answered=rep.answered,
                    continuations=rep.continuations)), "the batch's failure")
            except Exception:
                log.exception("batch %s: its failure could not be reported either", bid)
