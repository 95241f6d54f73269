"""The continuous engine's thread: one per worker process, stepping the instance's
``ContinuousRun`` while batch tasks (Celery threads) hand it groups and read back their output.

The decode thread only computes: each step's output (token events) is put on the group's queue
and the batch task that submitted it renders it into text (detokenizing, stop strings) and
publishes it (Redis streams, the log DB, cancel checks) on its own thread, so neither a slow
Redis round trip nor a long answer's text holds up the rows that are decoding. When the run raises, every
group in it is told (the tasks fail their rows explicitly) and a fresh run takes over.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from cohort.types import Batch
from workers.continuous import ContinuousRun
from workers.decode_outputs import StepOutput
from workers.row_text import TextStage

log = logging.getLogger(__name__)


@dataclass
class GroupUpdate:
    """One step's news for one group: what to publish, and its state after the step."""

    out: StepOutput = field(default_factory=StepOutput)
    alive: list[str] = field(default_factory=list)
    generated: int = 0
    admitted: bool = False
    done: bool = False
    error: str | None = None
    duplicate: bool = False  # the batch was already running here: its first copy answers


class GroupHandle:
    """A batch task's view of its group: the updates, rendered into text on the reader's thread,
    and what ``workers.tasks`` asks of a run (``alive_ids``, ``cancel``, ``generated``) as of the
    last update read. A row a stop string ended is cancelled in the engine and is no longer alive."""

    def __init__(self, loop: ContinuousLoop, batch_id: str, text: TextStage) -> None:
        self.loop, self.batch_id, self.text = loop, batch_id, text
        self.queue: queue.Queue[GroupUpdate] = queue.Queue()
        self._alive: list[str] = []
        self.generated = 0
        self.duplicate = False  # the batch was already running here (its first copy answers)

    def updates(self) -> Iterator[GroupUpdate]:
        """Every update until the group is done (or the run failed)."""
        while True:
            upd = self.queue.get()
            stopped = self.text.render(upd.out)
            if stopped:
                self.loop.cancel(stopped)
            self._alive, self.generated = [r for r in upd.alive if r not in self.text.ended], upd.generated
            if upd.duplicate:
                self.duplicate = True
                return
            yield upd
            if upd.done or upd.error is not None:
                return

    def alive_ids(self) -> list[str]:
        return list(self._alive)

    def cancel(self, request_ids: Iterable[str]) -> None:
        self.loop.cancel(request_ids)


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
        self._thread = threading.Thread(target=self._loop, name="continuous-engine", daemon=True)
        self._thread.start()

    def submit(self, batch: Batch, prompt_ids: Sequence[list[int]]) -> GroupHandle:
        handle = GroupHandle(self, batch.id, TextStage(self.run.tok))
        with self._lock:
            self._inbox.append((batch, prompt_ids, handle))
        self._wake.set()
        return handle

    def cancel(self, request_ids: Iterable[str]) -> None:
        with self._lock:
            self._cancels.extend(request_ids)
        self._wake.set()

    def drain(self, timeout_s: float) -> bool:
        """Wait until every submitted group has ended (a warm shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                empty = not self._inbox
            if empty and not self._handles:
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=10)

    def _take_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            cancels, self._cancels = self._cancels, []
        for batch, ids, handle in inbox:
            if batch.id in self._handles:  # a redelivery while the first copy runs: that copy answers
                handle.queue.put(GroupUpdate(done=True, duplicate=True))
                continue
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
                for handle in self._handles.values():
                    handle.queue.put(GroupUpdate(error=f"{type(e).__name__}: {e}"))
                self._handles.clear()
                self.run = self.make_run()
                continue
            self._publish(outs)

    def _publish(self, outs: dict[str, StepOutput]) -> None:
        run = self.run
        admitted = set(run.just_admitted)
        for bid, out in outs.items():
            g = run.groups[bid]
            self._handles[bid].queue.put(GroupUpdate(out, run.alive_ids(bid), g.generated, bid in admitted))
        for g in run.finished_groups():
            handle = self._handles.pop(g.batch.id)
            handle.queue.put(GroupUpdate(generated=g.generated, admitted=g.batch.id in admitted, done=True))
