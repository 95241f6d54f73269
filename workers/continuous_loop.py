"""The continuous engine's thread: one per worker process, stepping the instance's
``ContinuousRun`` while batch tasks hand it groups and one reader (``workers.group_publisher``)
takes back what every group's step produced.

The decode thread only computes: each step's output (token events, routed by group) goes on one
queue, and the reader renders it into text (detokenizing, stop strings: ``GroupHandle.render``)
and publishes it (Redis streams, the log DB, cancel checks) on its own thread, so neither a slow
Redis round trip nor a long answer's text holds up the rows that are decoding, and a group costs
no thread of its own. When the run raises, every group in it is told (their rows fail
explicitly) and a fresh run takes over.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from cohort.types import Batch
from workers.row_text import TextStage
from workers.step_outputs import StepOutput

if TYPE_CHECKING:  # the loop only calls the run it is handed: the upstream loop shares it without torch
    from workers.continuous import ContinuousRun

log = logging.getLogger(__name__)
Update = tuple["GroupHandle", "GroupUpdate"]


@dataclass
class GroupUpdate:
    """One step's news for one group: what to publish, and its state after the step."""

    out: StepOutput = field(default_factory=StepOutput)
    alive: list[str] = field(default_factory=list)
    generated: int = 0
    admitted: bool = False
    done: bool = False
    error: str | None = None
    # when (wall time) the group joined the engine's rows, where that comes before its news goes out
    # (an upstream worker's flush waits): its rows' queue time ends there, not at the publishing round
    admitted_at: float | None = None


class GroupHandle:
    """The reader's view of one group: its text stage. ``render`` turns an update's token events
    into text; a row a stop string ended is cancelled in the engine and is no longer alive."""

    def __init__(self, loop: ContinuousLoop, batch_id: str, text: TextStage) -> None:
        self.loop, self.batch_id, self.text = loop, batch_id, text

    def render(self, upd: GroupUpdate) -> GroupUpdate:
        stopped = self.text.render(upd.out)
        for req in upd.out.evicted:  # handed back to the batcher: held-back text and ids go out first
            self.text.evict(req, upd.out)
        if stopped:
            self.loop.cancel(stopped)
        upd.alive = [r for r in upd.alive if r not in self.text.ended]
        return upd


def drain(outbox: queue.Queue[list[Update]], timeout_s: float) -> list[Update]:
    """Every update an engine loop has produced since the last call, in order and rendered (at
    most ``timeout_s`` of waiting for the first): one reader drains them all at once, so a reader
    that fell behind catches up in one round."""
    try:
        bundles = [outbox.get(timeout=timeout_s)]
    except queue.Empty:
        return []
    while True:
        try:
            bundles.append(outbox.get_nowait())
        except queue.Empty:
            break
    return [(h, h.render(u)) for bundle in bundles for h, u in bundle]


class ContinuousLoop:
    """Owns the run and the thread that steps it."""

    def __init__(self, make_run: Callable[[], ContinuousRun], idle_wait_s: float = 0.5) -> None:
        self.make_run, self.idle_wait_s = make_run, idle_wait_s
        self.run = make_run()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._inbox: list[tuple[Batch, Sequence[list[int]], GroupHandle]] = []
        self._cancels: list[str] = []
        self._handles: dict[str, GroupHandle] = {}
        self.outbox: queue.Queue[list[Update]] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name="continuous-engine", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch, prompt_ids: Sequence[list[int]]) -> GroupHandle:
        """Hand the engine a group; it joins at the first step boundary where its plan fits. The
        caller makes sure a batch id is submitted once (``GroupPublisher.submit``)."""
        handle = GroupHandle(self, batch.id, TextStage(self.run.tok))
        with self._lock:
            self._inbox.append((batch, prompt_ids, handle))
        self._wake.set()
        return handle

    def counters(self) -> dict[str, float]:
        """The engine's running totals (read off its thread: growing numbers): prompt tokens looked
        up in the prefix cache and found there, steps, their seconds and Σ rows per step, and the
        rows resident and groups waiting now."""
        run = self.run
        return {"prefix_queries": run.book.pool.queries, "prefix_hits": run.book.pool.hits, "steps": run.steps,
                "busy_s": run.busy_s, "row_steps": run.row_steps, "rows": len(run.book.rows),
                "waiting_groups": len(run.book.waiting)}

    def updates(self, timeout_s: float) -> list[Update]:
        return drain(self.outbox, timeout_s)

    def cancel(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._cancels.extend(request_ids)
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for batch, ids, handle in inbox:
            self._handles[batch.id] = handle
            self.run.submit(batch, ids)
        if cancels:
            self.run.cancel(cancels)

    def _loop(self) -> None:
        while not self._stop.is_set():
            self._take_inbox()
            if self.run.idle:
                self._wake.wait(self.idle_wait_s)
                self._wake.clear()
                continue
            try:
                outs = self.run.step()
            except Exception as e:  # every group hears of it; a fresh run serves what comes next
                log.exception("the continuous run failed; its %d group(s) fail", len(self._handles))
                self.outbox.put([(h, GroupUpdate(error=f"{type(e).__name__}: {e}")) for h in self._handles.values()])
                self._handles.clear()
                self.run = self.make_run()
                continue
            self._publish(outs)

    def _publish(self, outs: dict[str, StepOutput]) -> None:
        run = self.run
        admitted = set(run.just_admitted)
        bundle = [(self._handles[bid], GroupUpdate(out, run.alive_ids(bid), run.groups[bid].generated, bid in admitted))
                  for bid, out in outs.items()]
        for g in run.finished_groups():
            handle = self._handles.pop(g.batch.id)
            bundle.append((handle, GroupUpdate(generated=g.generated, admitted=g.batch.id in admitted, done=True)))
        if bundle:
            self.outbox.put(bundle)
