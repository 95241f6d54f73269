"""A continuous instance's KV page pool, with the prefix cache in it.

Pages are fixed-size slots of the preallocated KV store. A page is *in use* while rows hold it
(a reference count: a prompt's shared pages are held by every row that reuses them), *cached* when
no row holds it but it keeps the KV of a full prompt page that may be asked for again, keyed by
``batcher.prefix_pages.page_hashes`` (the chained hash of everything up to and in it), or *free*.
``take`` hands out free pages first, then the least recently released cached ones (their key is
forgotten): a cached page costs nothing until the pool needs it. A page is cached only once its
KV is written (``cache``), so a lookup never returns a page still being prefilled.

Plain Python, no torch: ``batcher.running_set`` uses it in the worker and in the simulator alike.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence


class PagePool:
    """Page ids with reference counts and a hash index of cached full prompt pages."""

    def __init__(self, num_pages: int, caching: bool = True) -> None:
        self.num_pages = num_pages
        self.caching = caching
        self.free: deque[int] = deque(range(num_pages))
        self.refs = [0] * num_pages
        self.idle: OrderedDict[int, None] = OrderedDict()   # cached, held by no row: LRU first
        self.by_hash: dict[int, int] = {}                    # page hash -> page id
        self.hash_of: dict[int, int] = {}                    # page id -> its hash
        self.queries = 0                                     # prompt tokens looked up
        self.hits = 0                                        # of them, found cached

    @property
    def available(self) -> int:
        """Pages ``take`` can hand out now (free, or cached and held by no row)."""
        return len(self.free) + len(self.idle)

    def take(self, n: int) -> list[int] | None:
        """``n`` pages for a row to write, or None (nothing taken) if the pool has not that many."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                page = self.free.popleft()
            else:
                page, _ = self.idle.popitem(last=False)          # the least recently released
                del self.by_hash[self.hash_of.pop(page)]
            self.refs[page] = 1
            out.append(page)
        return out

    def give(self, pages: Sequence[int]) -> None:
        """A row lets go of its pages: unheld ones stay cached if they hold a known prefix, else free."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def lookup(self, hashes: Sequence[int]) -> list[int]:
        """The cached pages of the longest prefix of ``hashes`` (chained: the first miss ends it)."""
        out = []
        if self.caching:
            for h in hashes:
                page = self.by_hash.get(h)
                if page is None:
                    break
                out.append(page)
        return out

    def hold(self, pages: Sequence[int]) -> None:
        """A row reuses these cached pages: one more holder each (out of the LRU while held)."""
        for page in pages:
            if self.refs[page] == 0:
                del self.idle[page]
            self.refs[page] += 1

    def summary(self, limit: int) -> list[int]:
        """At most ``limit`` keys of cached pages, for prefix-aware routing: those rows hold first
        (they are in use now), then the most recently released. Bounded, so an instance with a
        large pool publishes a fixed-size summary of what its next lookups most likely find."""
        held = [h for page, h in list(self.hash_of.items()) if self.refs[page] > 0]
        out = held[:limit]
        for page in reversed(list(self.idle)):
            if len(out) >= limit:
                break
            h = self.hash_of.get(page)
            if h is not None:
                out.append(h)
        return out

    def cache(self, page: int, h: int) -> None:
        """``page`` now holds the written KV of the full prompt page keyed ``h``: later prompts may
        reuse it. A key already cached keeps its page (this one stays the row's own)."""
        if self.caching and h not in self.by_hash and page not in self.hash_of:
            self.by_hash[h] = page
            self.hash_of[page] = h
