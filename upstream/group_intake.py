"""An upstream instance's inbox of groups, taken on its engine loop's own thread.

The batcher hands an upstream-only pool's groups over on Redis sorted sets
(``release_bus.group_set``: the pool's, and the instance's own for routed ones), taken best first in
the policy's order (``release_bus.hand_over``), instead of one Celery task each (a task cost the
batcher a publish and the worker a delivery, an ack and their bookkeeping: about half of an
upstream worker's CPU per request at 30 req/s, measured with `cohort bench front`).

The pop, the claim and the hand-over to admission run on the asyncio thread that admits the groups
(``upstream.admission.UpstreamLoop``), not on a thread of their own: at a group per request, a
thread that blocks on the pop and hands each group to the loop made the worker's threads contend for
the interpreter's lock on every step of a request (docs/notes/front.md, run 17).

A group is claimed as the Celery task's body claims its batch (``workers.tasks.queue_claim``), so the
batcher knows whose it is: a group popped by an instance that dies before claiming it is re-queued
once it has been unclaimed for two heartbeat TTLs (``BatcherService._check_lost``), one that dies
after as any running batch. The instance keeps its Celery worker for pools that mix engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from cohort.release_bus import group_payload, group_set
from cohort.types import Batch, ProfiledRequest
from workers.continuous_loop import GroupHandle
from workers.row_text import TextStage
from workers.tasks import claimed, queue_claim

log = logging.getLogger(__name__)


class Room:
    """Whether every group handed to admission has joined its engine's rows: a ``threading.Event``
    for a caller's thread (``UpstreamLoop.submit``), and an awaitable for the loop's own intake.
    Set only on the loop's thread."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self._event.set()
        self._wake: asyncio.Event | None = None

    def set(self) -> None:
        self._event.set()
        if self._wake is not None:
            self._wake.set()

    def clear(self) -> None:
        self._event.clear()

    def wait(self, timeout_s: float) -> bool:
        return self._event.wait(timeout_s)

    async def wait_async(self, timeout_s: float) -> None:
        if self._event.is_set():
            return
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), timeout_s)


@dataclass
class GroupSource:
    """Where an instance's groups come from and what it does with one once claimed."""

    redis: Any  # an asyncio client of its own: the pop blocks its connection
    pool: str
    instance: str
    visibility_timeout_s: float
    register: Callable[[Batch], bool]  # the publisher reports for it from now on (False: it runs here already)
    prompt_ids: Callable[[ProfiledRequest], list[int]]
    stop: threading.Event

    @property
    def keys(self) -> list[str]:
        return [group_set(self.pool, self.instance), group_set(self.pool)]  # its own first

    async def next_group(self) -> Batch | None:
        """The best group waiting, claimed by this instance (None: none within a second, or one
        already done, cancelled or claimed elsewhere)."""
        got = await self.redis.bzpopmin(self.keys, timeout=1)  # pops from the first key holding one
        if not got:
            return None
        b = Batch.from_dict(json.loads(group_payload(got[1])))
        pipe = self.redis.pipeline(transaction=False)
        queue_claim(pipe, b.id, self.instance, self.visibility_timeout_s)
        if not claimed(await pipe.execute(), self.instance):
            log.info("batch %s: already done, cancelled or claimed elsewhere; skipped", b.id)
            return None
        if not self.register(b):
            log.info("batch %s: already running on this instance; this copy is skipped", b.id)
            return None
        return b


async def serve_groups(intake: GroupSource, take: Callable[[Batch, list[list[int]]], None],
                       room: Callable[[], Any]) -> None:
    """Take groups until ``intake.stop``: each claimed one goes to admission (``take``), then the
    next waits for ``room`` (``UpstreamLoop._after_take``). A Redis outage is ridden out as the Celery
    consumer does; a group that cannot be read is logged (the batcher re-queues it as unclaimed)."""
    backoff = 0.2
    while not intake.stop.is_set():
        try:
            b = await intake.next_group()
            backoff = 0.2
        except Exception as e:  # a group that cannot be read is logged too, never a tight loop of errors
            if isinstance(e, RedisError):
                log.warning("reading groups failed (%s); retrying in %.1f s", e, backoff)
            else:
                log.exception("a group could not be taken")
            await asyncio.sleep(backoff)
            backoff = min(5.0, backoff * 2)
            continue
        if b is not None:
            take(b, [intake.prompt_ids(r) for r in b.requests])
            await room()


class TakesGroups:
    """How ``upstream.admission.UpstreamLoop`` takes groups on its own thread (a mixin: it owns the
    groups, the room and the thread)."""

    _room: Room
    _submitted: int
    _intake: GroupSource | None = None
    down: bool
    take_wait_s: float

    def start_intake(self, intake: GroupSource) -> None:
        """Serve ``intake`` on the loop's thread until its ``stop`` is set. The loop holds it: asyncio
        holds tasks weakly, and a task blocked on its client's read is otherwise only in a cycle with
        that client (its transport holds the stream reader weakly), which the collector closes."""
        self._intake = intake
        self._call(serve_groups(intake, self._take_claimed, self._after_take))

    def _take_claimed(self, batch: Batch, prompt_ids: list[list[int]]) -> None:
        self._submitted += 1
        self._room.clear()
        self._take(batch, prompt_ids, GroupHandle(self, batch.id, TextStage(self.tok)))

    async def _after_take(self) -> None:
        """As ``UpstreamLoop.submit`` waits on a caller's thread: a down server's instance waits a
        moment before its next group (the pool's other instances get it); while a group waits here
        for room, the next one stays on the pool's set (up to ``take_wait_s``)."""
        if self.down:
            await asyncio.sleep(1.0)
        elif self.take_wait_s > 0:
            await self._room.wait_async(self.take_wait_s)
