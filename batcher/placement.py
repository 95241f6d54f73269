"""Where the live batcher puts a batch: on one instance's own queue, the instance with room that
holds the most of its prompts' KV pages (prefix-aware routing, ``batcher.prefix_routing``), else
the least loaded one with room; on the pool's queue (any instance takes it) only when none has room.

Why the least loaded and not the pool's queue: instances that pull from one queue take batches in
turn, whatever runs on each, so one engine queues while another has room. On a fleet of four
KV-bound engines at 0.9 of capacity (docs/fleet.md) the pool's queue gave a mean TTFT twice that of
a client that sends each request to the engine with the fewest in flight; placing by load beat
that client.

The service owns the in-flight batches; this module owns what routing needs beside them: the
instances' prefix views (their published summaries, read from Redis), which instances have room
for one more batch, and the clean-up of a gone instance's queue.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import redis

from batcher.prefix_pages import decode_summary
from batcher.prefix_routing import PrefixRouter
from cohort import bus
from cohort.release_bus import group_list
from cohort.settings import Settings
from cohort.types import Batch, InstanceInfo


class Placed(Protocol):
    """What placement reads of an in-flight batch (``batcher.service.Inflight``)."""

    batch: Batch
    admitted: bool
    target: str | None
    owner: str | None


@dataclass
class Placement:
    """Prefix-aware placement of one pool's batches (built only with ``COHORT_PREFIX_ROUTING`` on)."""

    settings: Settings
    redis: redis.Redis
    router: PrefixRouter = field(default_factory=PrefixRouter)
    model: str = ""
    _last_summaries: float = float("-inf")

    def __post_init__(self) -> None:
        self.router.page_tokens = self.settings.continuous.page_tokens

    def sync(self, alive: dict[str, InstanceInfo], gone: list[str], now: float) -> None:
        """Follow the live instances; read their prefix summaries about as often as they write them."""
        for name in gone:  # nobody consumes a gone instance's queue: what waits there is re-queued
            # by the lost-batch check (its target is gone); an upstream's groups wait on a list of its own
            self.redis.delete(bus.queue_for_instance(name), group_list(self.settings.pool, name))
        self.router.sync_instances({n: i.theta_bytes // max(1, i.delta_bytes) for n, i in alive.items()})
        if alive:
            self.model = next(iter(alive.values())).model
        if alive and now - self._last_summaries >= max(0.5, self.settings.instance_ttl_s / 3):
            self._last_summaries = now
            for name, text in bus.prefix_summaries(self.redis, alive).items():
                if text:
                    self.router.report(name, decode_summary(text))

    def with_room(self, inflight: list[Placed]) -> list[str]:
        """Instances that may take one more batch now, least loaded first. Continuous: fewer than
        ``lookahead`` of its batches wait to be admitted and fewer than ``max_groups`` run; padded
        execution: none of its batches is in flight. Batches still on the pool queue count for no
        instance until one claims them."""
        s = self.settings
        total = dict.fromkeys(self.router.views, 0)
        waiting = dict.fromkeys(self.router.views, 0)
        for fl in inflight:
            where = fl.target or fl.owner
            if where in total:
                total[where] += 1
                waiting[where] += not fl.admitted
        if s.execution == "continuous":
            ok = [n for n in total if waiting[n] < s.continuous.lookahead and total[n] < s.continuous.max_groups]
        else:
            ok = [n for n in total if total[n] == 0]
        return sorted(ok, key=lambda n: (total[n], n))

    def target(self, batch: Batch, inflight: list[Placed]) -> tuple[str | None, bool]:
        """The instance to route ``batch`` to: of those with room, the one holding most of its
        prompts' pages, else the least loaded; None (the pool queue) when none has room. The flag:
        chosen for its cached prefix (the log says which)."""
        room = self.with_room(inflight)
        cached = self.router.choose(batch, room, self.model)
        name = cached or (room[0] if room else None)
        if name is not None:
            self.router.record(name, batch, self.model)
            self.router.forget(r.id for r in batch.requests)
        return name, cached is not None

    def claimed(self, fl: Placed, owner: str | None) -> None:
        """What an in-flight batch's claim marker says (None: unclaimed yet). The first real claim
        is remembered; a pool-queue batch's prompts are cached on its claimer from then on."""
        if not owner or owner == bus.CANCELLED or fl.owner is not None:
            return
        fl.owner = owner
        if fl.target is None:
            self.router.record(owner, fl.batch, self.model)
            self.router.forget(r.id for r in fl.batch.requests)
