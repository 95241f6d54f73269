"""Prefix-aware routing: send an admission group to the instance that already holds its prompts'
leading KV pages, so that instance prefills only the rest.

A pool's instances pull batches from one queue; with routing on, the batcher may instead put a
batch on one instance's own queue (``bus.queue_for_instance``). What it knows of each instance:

- **Reported.** A built-in instance with prefix caching publishes the keys of the pages its pool
  holds (``PagePool.summary``, bounded, written with its heartbeat): exactly what a lookup there
  would find, a few seconds old.
- **Sent.** Every batch the batcher routed to an instance, or saw an instance claim from the pool
  queue, leaves its prompts' page keys in a per-instance LRU as large as that instance's KV. Between
  two reports this covers what was sent since; for an upstream (vLLM caches prefixes itself and
  reports none) it is all cohort knows: the prefixes it sent there.

The choice (``PrefixRouter.choose``) is the simulator's rule carried over: among the instances that
have room now, the one on which the batch's prompts have the most cached tokens; an instance
without room is never chosen, so affinity is bounded by load and one hot prompt cannot pin one
instance. A batch that matches nowhere goes to the least loaded instance with room
(``batcher.placement``).

Torch-free and Redis-free: the batcher service feeds it, and tests drive it directly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from batcher.prefix_groups import prompt_pages
from batcher.prefix_pages import held_prefix_pages, page_salt
from cohort.types import Batch, ProfiledRequest

MAX_REMEMBERED = 100_000  # requests whose page keys are kept between dispatch and claim


@dataclass
class InstancePrefixes:
    """What the batcher believes one instance holds: its last report and what was sent since."""

    capacity_pages: int
    reported: frozenset[int] = frozenset()
    sent: OrderedDict[int, None] = field(default_factory=OrderedDict)  # least recently sent first

    def add_sent(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            self.sent[h] = None
            self.sent.move_to_end(h)
        while len(self.sent) > self.capacity_pages:
            self.sent.popitem(last=False)

    def cached_pages(self, hashes: Sequence[int]) -> int:
        """Leading pages of ``hashes`` held here (chained keys: the first miss ends the prefix)."""
        return held_prefix_pages(hashes, self.reported, self.sent)


@dataclass
class PrefixRouter:
    """The instances' prefix views and the routing rule (see the module docstring)."""

    page_tokens: int = 16
    views: dict[str, InstancePrefixes] = field(default_factory=dict)
    _hashes: dict[str, list[int]] = field(default_factory=dict)  # request id -> its prompt's page keys

    def sync_instances(self, capacities: dict[str, int]) -> None:
        """Keep a view per live instance (``capacities``: name -> KV tokens); a gone instance's
        view goes with it (a restarted worker starts with an empty cache)."""
        for name in set(self.views) - set(capacities):
            del self.views[name]
        for name, tokens in capacities.items():
            pages = max(1, tokens // self.page_tokens)
            view = self.views.get(name)
            if view is None:
                self.views[name] = InstancePrefixes(capacity_pages=pages)
            else:
                view.capacity_pages = pages

    def report(self, instance: str, hashes: frozenset[int]) -> None:
        """An instance's published summary replaces its last one."""
        if instance in self.views:
            self.views[instance].reported = hashes

    def hashes(self, req: ProfiledRequest, model: str) -> list[int]:
        """The page keys of what the request's instance must prefill (prompt, plus the tokens a
        continuation already generated), keyed exactly as the worker keys its pages."""
        got = self._hashes.get(req.id)
        if got is None:
            got = prompt_pages(req, self.page_tokens, page_salt(model))
            if len(self._hashes) >= MAX_REMEMBERED:  # forgotten requests (cancelled, failed): start over
                self._hashes.clear()
            self._hashes[req.id] = got
        return got

    def forget(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self._hashes.pop(rid, None)

    def cached_tokens(self, batch: Batch, instance: str, model: str) -> int:
        """Prompt tokens of ``batch`` that ``instance`` would find cached."""
        view = self.views.get(instance)
        if view is None:
            return 0
        return self.page_tokens * sum(view.cached_pages(self.hashes(r, model)) for r in batch.requests)

    def best_cached_tokens(self, req: ProfiledRequest, model: str) -> int:
        """Prompt tokens of ``req`` cached on the instance holding the most of them (where ``choose``
        would send it, room permitting): what a policy leaves out of its KV plan."""
        hashes = self.hashes(req, model)
        return self.page_tokens * max((v.cached_pages(hashes) for v in self.views.values()), default=0)

    def choose(self, batch: Batch, with_room: Sequence[str], model: str) -> str | None:
        """The instance with room on which the most of the batch's prompt tokens are cached (ties:
        the first of ``with_room``, which the caller orders least loaded first); None when none
        holds any of them."""
        best, best_tokens = None, 0
        for name in with_room:
            tokens = self.cached_tokens(batch, name, model)
            if tokens > best_tokens:
                best, best_tokens = name, tokens
        return best

    def record(self, instance: str, batch: Batch, model: str) -> None:
        """``batch`` runs on ``instance``: its prompts' pages are cached there from now on."""
        view = self.views.get(instance)
        if view is not None:
            for r in batch.requests:
                view.add_sent(self.hashes(r, model))
