"""What a request shares with the admission group it may join: the one rule a policy uses to group
requests by prefix (issue: prefix-aware batching).

A group's rows run on one instance. With a prefix cache there (the built-in engine's pages, or an
upstream's own, as vLLM's), a page two rows share is held once and prefilled once, so a member's
KV need and prefill are its *uncached part*: its prompt less the leading pages the group already
holds, or that the instance it would go to holds (``PolicyContext.cached_tokens``: routing sends a
group where the most of its prefix is), whichever is longer. ``GroupPages`` keeps the page keys a group holds and answers that per candidate; the keys are
``batcher.prefix_pages.page_hashes`` of the prompt ids (no salt: rows of one group share a model,
and these keys never leave the policy).

Torch-free and Redis-free, like the policies that use it.
"""

from __future__ import annotations

from collections.abc import Sequence

from batcher.prefix_pages import held_prefix_pages, page_hashes
from cohort.types import ProfiledRequest


def prompt_pages(req: ProfiledRequest, page_tokens: int, salt: str = "") -> list[int]:
    """The keys of the request's full prompt pages (what a continuation must prefill included),
    under ``salt`` (``page_salt``: the router keys them exactly as the worker does); none when it
    carries no token ids (the simulator's traces without prompts) or paging is off."""
    ids = (req.prompt_ids or []) + list(req.generated_ids)
    return page_hashes(ids, page_tokens, salt) if page_tokens > 0 and len(ids) >= page_tokens else []


class GroupPages:
    """The page keys one group being assembled holds, and what a candidate would add."""

    __slots__ = ("page_tokens", "held")

    def __init__(self, page_tokens: int) -> None:
        self.page_tokens = page_tokens
        self.held: set[int] = set()

    def shared_tokens(self, pages: Sequence[int]) -> int:
        """Leading prompt tokens of a row with these page keys that the group already holds
        (chained keys: the first page it lacks ends the shared prefix)."""
        return held_prefix_pages(pages, self.held) * self.page_tokens

    def uncached_input(self, req: ProfiledRequest, pages: Sequence[int], cached: int = 0) -> int:
        """L(p) as the group plans it: its input less what the group holds or the instance holds
        (``cached`` tokens), at least one token (the last prompt token is always computed, to
        sample the first new one)."""
        return max(1, req.input_tokens - max(self.shared_tokens(pages), cached))

    def add(self, pages: Sequence[int]) -> None:
        self.held.update(pages)


def shared_by_longer_lived(pages: Sequence[Sequence[int]], remaining: Sequence[int], prompt_tokens: Sequence[int],
                           page_tokens: int) -> list[int]:
    """Tokens of each row's prompt that a row planned to run at least as long holds already: what
    the row's KV need leaves out where one instance runs them together. An engine with a prefix
    cache (vLLM's blocks, the built-in page pool) holds a page that running rows share once, for as
    long as any of them runs; so each shared page is charged to its longest-lived holder, which keeps
    it to that holder's end, and the running set's planned peak stays exact. A row holds every full
    page of its prompt, and finds the others' pages for all of its own but the page of its last
    token, which an engine computes again to sample the next one (``pages``: each row's
    ``batcher.prefix_pages.page_hashes`` at the engine's page size, of its ``prompt_tokens``; ties
    keep the given order)."""
    held: set[int] = set()
    out = [0] * len(pages)
    for i in sorted(range(len(pages)), key=lambda i: -remaining[i]):
        reusable = pages[i][:max(0, prompt_tokens[i] - 1) // page_tokens]
        out[i] = held_prefix_pages(reusable, held) * page_tokens
        held.update(pages[i])
    return out
