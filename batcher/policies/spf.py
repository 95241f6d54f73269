"""Shortest predicted first, with linear aging (``spf``): cohort's admission order for continuous execution.

Why: on a continuous engine at saturation the queue, not the batch, is where time goes, and
serving the shortest predicted answers first is what cuts mean latency and TTFT (SRPT's rule).
Pure SPF starves the longest answers (p99), so a request's rank improves by ``aging`` predicted
tokens per second of waiting:

    key(p) = G'(p) − aging · (now − arrival(p))

``now`` is common to every waiting request, so ranking by ``G'(p) + aging · arrival(p)`` is the
same order at every instant: one heap, no re-sorting. ``aging = 0`` is pure SPF, a very large
``aging`` is FCFS. A batch (an *admission group* under ``continuous``) is the head of that order
plus the next requests of the same batch key while the memory rule (``PolicyContext.plan``) still
fits: neighbours in the order have similar predicted lengths, so the group pads little even under
static execution. Measured choice of ``aging`` (5 tokens/s): docs/notes/benchmarks.md, "Continuous
execution".

Under continuous execution over a prefix cache (``PolicyContext.prefix_page_tokens``) a group is
also grouped by prefix: after its head come the waiting requests whose prompt starts with the
head's first page (the same system prompt, the same conversation), in key order and at most
``prefix_window`` predicted tokens of rank behind the head, so a shared prompt is prefilled once on
one instance and no request jumps far ahead of its turn; then the rest in key order as above. Each
member is planned with its uncached part (``batcher.prefix_groups``): the pages it shares with the
group count once, and those the instance it would go to holds are not counted.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from itertools import count

from batcher.policies.base import NextOpen, Policy, PolicyContext, Rank
from batcher.prefix_groups import GroupPages, prompt_pages
from cohort.settings import Settings
from cohort.types import Batch, ProfiledRequest, new_id

# predicted tokens of rank gained per second of waiting: COHORT_SPF_AGING's default, one owner
DEFAULT_AGING: float = Settings.model_fields["spf_aging"].default
DEFAULT_PREFIX_WINDOW: float = Settings.model_fields["spf_prefix_window"].default


class _Entry:
    """One waiting request: its rank, its prompt's page keys (prefix grouping) and whether it still
    waits (taken entries leave the heap and the prefix index lazily)."""

    __slots__ = ("key", "seq", "req", "pages", "waiting")

    def __init__(self, key: float, seq: int, req: ProfiledRequest, pages: list[int]) -> None:
        self.key, self.seq, self.req, self.pages, self.waiting = key, seq, req, pages, True

    def __lt__(self, other: _Entry) -> bool:
        return (self.key, self.seq) < (other.key, other.seq)


class SPFPolicy(Policy):
    """Groups in order of G'(p) + aging·arrival(p), each packed under Θ (module docstring)."""

    def __init__(self, ctx: PolicyContext, aging: float = DEFAULT_AGING,
                 prefix_window: float = DEFAULT_PREFIX_WINDOW) -> None:
        super().__init__(ctx)
        if aging < 0:
            raise ValueError("aging must be >= 0")
        if prefix_window < 0:
            raise ValueError("prefix_window must be >= 0")
        self.aging = float(aging)
        self.prefix_window = float(prefix_window)
        self._heap: list[_Entry] = []
        # waiting requests by their prompt's first page (seq -> entry): a taken one leaves at once
        self._by_first_page: dict[int, dict[int, _Entry]] = {}
        self._seq = count()

    def key(self, req: ProfiledRequest) -> float:
        """The rank of one request (lower goes first); see the module docstring."""
        return float(req.predicted_tokens) + self.aging * req.arrival

    def add(self, req: ProfiledRequest, now: float) -> None:
        entry = _Entry(self.key(req), next(self._seq), req, prompt_pages(req, self.ctx.prefix_page_tokens))
        heapq.heappush(self._heap, entry)
        if entry.pages:
            self._by_first_page.setdefault(entry.pages[0], {})[entry.seq] = entry

    def _taken(self, e: _Entry) -> None:
        """``e`` leaves the waiting set: marked for the heap (dropped lazily), out of the index now."""
        e.waiting = False
        if e.pages:
            same = self._by_first_page[e.pages[0]]
            del same[e.seq]
            if not same:
                del self._by_first_page[e.pages[0]]

    def _head(self) -> _Entry | None:
        """The first entry still waiting (taken ones are dropped from the heap's top here)."""
        heap = self._heap
        while heap and not heap[0].waiting:
            heapq.heappop(heap)
        return heap[0] if heap else None

    def _next_open(self, now: float) -> NextOpen | None:
        head = self._head()
        if head is None:
            return None
        return NextOpen((head.key,), lambda: self._take(now))

    def _ranks(self, batches: Sequence[Batch], now: float) -> list[Rank]:
        return [(min(self.key(r) for r in b.requests),) for b in batches]

    def _take(self, now: float) -> Batch:
        """The head request, its prefix mates, then its successors in key order (same batch key)
        while they fit Θ (module docstring)."""
        heap = self._heap
        first = self._head()
        assert first is not None, "_take follows _next_open"
        heapq.heappop(heap)
        self._taken(first)
        head = first.req
        plan = self.ctx.plan()
        group = GroupPages(self.ctx.prefix_page_tokens)
        held = self.ctx.cached_tokens if first.pages else None  # the instance's cache counts only where pages do

        def planned_input(e: _Entry) -> int:
            return group.uncached_input(e.req, e.pages, held(e.req) if held else 0) if e.pages else e.req.input_tokens

        plan.add(planned_input(first), head.planned_tokens)
        group.add(first.pages)
        members = [head]

        def join(e: _Entry) -> bool:
            L = planned_input(e)
            if not plan.fits_with(L, e.req.planned_tokens):
                return False
            plan.add(L, e.req.planned_tokens)
            group.add(e.pages)
            self._taken(e)
            members.append(e.req)
            return True

        if first.pages:
            for e in self._mates(first):
                if not join(e):
                    break
        other = []
        while heap:
            e = heap[0]
            if not e.waiting:
                heapq.heappop(heap)
                continue
            if e.req.batch_key != head.batch_key:
                other.append(heapq.heappop(heap))
                continue
            if not join(e):
                break
            heapq.heappop(heap)
        for e in other:
            heapq.heappush(heap, e)
        return Batch(id=new_id("b"), requests=members, created=now)

    def _mates(self, first: _Entry) -> list[_Entry]:
        """Waiting requests that start with ``first``'s first page (same batch key), in key order,
        at most ``prefix_window`` of rank behind it."""
        limit = first.key + self.prefix_window
        same = self._by_first_page.get(first.pages[0], {}).values()
        return sorted(e for e in same if e.key <= limit and e.req.batch_key == first.req.batch_key)
