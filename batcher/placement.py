"""Where the live batcher puts a batch: on one instance's own queue, the instance with room that
holds the most of its prompts' KV pages (prefix-aware routing, ``batcher.prefix_routing``), else
the least loaded one with room; on the pool's queue (any instance takes it) only when none has room.

Room is counted in batches and in KV: a continuous instance has room for a batch while few of its
batches wait and the batch's rows fit beside the rows of every batch it already holds, each at its
prompt and planned length, by the one running-set rule (``batcher.kv_judge``), the prompt pages
rows share counted once (the engine's prefix cache holds them once): counted per row, rows of one
system prompt filled a KV-bound engine on paper, and the next one went to an engine without its
prefix (chat-prefix trace: hit rate 0.41 -> 0.61, mean TTFT 0.77x -> 0.18x of round-robin's,
docs/notes/fleet.md). Counting batches
alone, an engine running one long row looks less loaded than one running two short ones; on a
KV-bound fleet a short request sent there waited a second for the long row's pages (docs/notes/fleet.md).
A batch that fits nowhere goes to the pool's queue, where the first instance with room takes it.

Why the least loaded and not the pool's queue: instances that pull from one queue take batches in
turn, whatever runs on each, so one engine queues while another has room. On a fleet of four
KV-bound engines at 0.9 of capacity (docs/notes/fleet.md) the pool's queue gave a mean TTFT twice that of
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

from batcher.kv_judge import KVJudge
from batcher.prefix_groups import prompt_pages, shared_by_longer_lived
from batcher.prefix_pages import decode_summary
from batcher.prefix_routing import PrefixRouter
from cohort import bus
from cohort.release_bus import group_set
from cohort.settings import Settings
from cohort.types import Batch, InstanceInfo, ProfiledRequest

PAGES_KEPT_SPARE = 1024  # requests' pages kept beyond twice those in flight before the gone ones are dropped


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
    capacity: dict[str, int] = field(default_factory=dict)  # live instances' KV, in tokens
    pages: dict[str, int] = field(default_factory=dict)     # and their KV pages' tokens
    overcommit: dict[str, float] = field(default_factory=dict)  # and how far past it a plan may reach
    _last_summaries: float = float("-inf")
    _row_pages: dict[tuple[str, int], list[int]] = field(default_factory=dict)  # (request id, page size) -> pages

    def __post_init__(self) -> None:
        self.router.page_tokens = self.settings.continuous.page_tokens

    def sync(self, alive: dict[str, InstanceInfo], gone: list[str], now: float) -> None:
        """Follow the live instances; read their prefix summaries about as often as they write them."""
        for name in gone:  # nobody consumes a gone instance's queue: what waits there is re-queued
            # by the lost-batch check (its target is gone); an upstream's groups wait on a set of its own
            self.redis.delete(bus.queue_for_instance(name), group_set(self.settings.pool, name))
        self.capacity = {n: i.theta_bytes // max(1, i.delta_bytes) for n, i in alive.items()}
        self.pages = {n: i.page_tokens or self.settings.continuous.page_tokens for n, i in alive.items()}
        self.overcommit = {n: self.settings.upstream_kv_overcommit if i.upstream else 0.0 for n, i in alive.items()}
        self.router.sync_instances(self.capacity)
        if alive:
            self.model = next(iter(alive.values())).model
        if alive and now - self._last_summaries >= max(0.5, self.settings.instance_ttl_s / 3):
            self._last_summaries = now
            for name, text in bus.prefix_summaries(self.redis, alive).items():
                if text:
                    self.router.report(name, decode_summary(text))

    def with_room(self, inflight: list[Placed], batch: Batch | None = None, stretch: bool = False) -> list[str]:
        """Instances that may take one more batch (``batch``, when given) now, least loaded first.
        Continuous: fewer than ``lookahead`` of its batches wait to be admitted, fewer than
        ``max_groups`` run, and ``batch`` fits beside them (``fits_beside``); padded execution: none
        of its batches is in flight. Batches still on the pool queue count for no instance until one
        claims them. ``stretch``: upstream instances' KV as far as their workers admit past it, where
        no batch waits (the batch is the next its worker admits)."""
        s = self.settings
        total = dict.fromkeys(self.router.views, 0)
        waiting = dict.fromkeys(self.router.views, 0)
        held: dict[str, list[Batch]] = {n: [] for n in self.router.views}
        for fl in inflight:
            where = fl.target or fl.owner
            if where in total:
                total[where] += 1
                waiting[where] += not fl.admitted
                held[where].append(fl.batch)
        if s.execution == "continuous":
            self._keep_pages_of(inflight, batch)
            ahead = 1 if stretch else s.continuous.lookahead  # past the plan: as the next group its worker admits
            ok = [n for n in total if waiting[n] < ahead and total[n] < s.continuous.max_groups
                  and (batch is None or self.fits_beside(n, held[n], batch, stretch))]
        else:
            ok = [n for n in total if total[n] == 0]
        return sorted(ok, key=lambda n: (total[n], n))

    def fits_beside(self, instance: str, held: list[Batch], batch: Batch, stretch: bool = False) -> bool:
        """Whether ``batch``'s rows fit ``instance``'s KV beside the rows of the batches it holds,
        each planned from its prompt to its planned length (what the batcher knows: not how far a
        row has got), in the instance's own pages (a vLLM CPU build's hold 128 tokens). An instance
        that holds nothing takes any batch.

        ``stretch``: an upstream instance is judged with the overcommit its worker may admit with
        (``COHORT_UPSTREAM_KV_OVERCOMMIT``, the cap of ``upstream.rows.PlanReach``); ``target``
        says when."""
        if not held:
            return True
        rows = [r for b in (*held, batch) for r in b.requests]
        s = self.settings
        page = self.pages.get(instance, s.continuous.page_tokens)
        judge = KVJudge(self.capacity.get(instance, 0), page, s.continuous.max_rows,
                        overcommit=self.overcommit.get(instance, 0.0) if stretch else 0.0)
        remaining = [r.run_plan_tokens for r in rows]
        sizes = [len(r.prompt_ids or []) + len(r.generated_ids) for r in rows]  # what ``prompt_pages`` pages
        shared = shared_by_longer_lived([self._pages(r, page) for r in rows], remaining, sizes, page)
        return judge.running_set_fits([r.input_tokens for r in rows], remaining, shared=shared)

    def _pages(self, req: ProfiledRequest, page_tokens: int) -> list[int]:
        """The request's prompt pages at an instance's page size, kept while it may be in flight
        (the same request is judged beside every batch placed after it)."""
        key = (req.id, page_tokens)
        got = self._row_pages.get(key)
        if got is None:
            got = self._row_pages[key] = prompt_pages(req, page_tokens)
        return got

    def _keep_pages_of(self, inflight: list[Placed], batch: Batch | None) -> None:
        """Forget the pages of requests no longer in flight, once they outnumber those that are
        (a chat prompt's pages are a few hundred bytes; a day of requests would hold gigabytes)."""
        if len(self._row_pages) <= PAGES_KEPT_SPARE:  # the common case: not worth listing who is in flight
            return
        live = {r.id for fl in inflight for r in fl.batch.requests} | {r.id for r in (batch.requests if batch else ())}
        if len(self._row_pages) > 2 * len(live) + PAGES_KEPT_SPARE:
            self._row_pages = {k: v for k, v in self._row_pages.items() if k[0] in live}

    def target(self, batch: Batch, inflight: list[Placed]) -> tuple[str | None, bool]:
        """The instance to route ``batch`` to: of those with room, the one holding most of its
        prompts' pages, else the least loaded; None (the pool queue) when none has room. The flag:
        chosen for its cached prefix (the log says which).

        An upstream instance holding at least half of the batch's prompt, where no batch waits, has
        room as far past its KV as its worker admits (``stretch``): the batch waits there as the
        next its worker admits, beside the rows that hold its prefix, rather than go to an engine
        without it (chat-prefix trace on 200-block engines: hit rate 0.58 -> 0.62 on the mean,
        docs/notes/fleet.md). Every other batch waits on the pool's queue when no instance has room
        by the plan, where the first instance to free room takes the best one: sent past the plan
        to the least loaded engine, or behind another batch at its prefix's holder (the Magnus
        tasks' prompts repeat), a Magnus group waited there while another engine freed room first."""
        room = self.with_room(inflight, batch)
        cached = self.router.choose(batch, room, self.model)
        if cached is None and any(self.overcommit.values()) and self._mostly_held(batch, list(self.router.views)):
            cached = self._mostly_held(batch, self.with_room(inflight, batch, stretch=True))
        name = cached or (room[0] if room else None)
        if name is not None:
            self.router.record(name, batch, self.model)
            self.router.forget(r.id for r in batch.requests)
        return name, cached is not None

    def _mostly_held(self, batch: Batch, instances: list[str]) -> str | None:
        """Of ``instances``, the one holding the most of the batch's prompt tokens, if that is at
        least half of them: worth waiting for (a system prompt), where a task's one-line
        instruction is not (the Magnus tasks share a page or two)."""
        name = self.router.choose(batch, instances, self.model)
        if name is None:
            return None
        prompt = sum(r.input_tokens for r in batch.requests)
        return name if 2 * self.router.cached_tokens(batch, name, self.model) >= prompt else None

    def claimed(self, fl: Placed, owner: str | None) -> None:
        """What an in-flight batch's claim marker says (None: unclaimed yet). The first real claim
        is remembered; a pool-queue batch's prompts are cached on its claimer from then on."""
        if not owner or owner == bus.CANCELLED or fl.owner is not None:
            return
        fl.owner = owner
        if fl.target is None:
            self.router.record(owner, fl.batch, self.model)
            self.router.forget(r.id for r in fl.batch.requests)
