"""The continuous engine's row book: which rows run, which KV pages each
holds, who joins at the next step boundary, whom to evict when pages run out.

Plain Python, no torch: the bookkeeping is tested on hand-built rows without a model, and the
executor (tensors only) reads the block tables this book hands out. KV lives in fixed-size pages
from a preallocated pool, so a growing row takes one more page id instead of re-allocating its
cache; a finished or evicted row returns its pages to the free list at once, which is what lets
the next admission group join mid-batch. Eviction reuses ``batcher.elastic.eviction_order`` (the
one rule for whom to preempt), so live continuous execution preempts the same row the elastic
path and the simulator would.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from batcher.elastic import eviction_order, running_set_fits
from batcher.row_cost import OnlineStepCost, row_pays
from batcher.row_priority import least_urgent
from cohort.settings import Settings

DEFAULT_MAX_ROWS = Settings.model_fields["continuous_max_rows"].default  # vLLM's max_num_seqs
log = logging.getLogger(__name__)


def pages_for(tokens: int, page_size: int) -> int:
    """Pages needed to hold ``tokens`` KV entries (ceiling division; 0 tokens need 0 pages)."""
    return -(-tokens // page_size)


@dataclass
class BookRow:
    """One running row: its id, how many KV entries it holds, its pages and its eviction facts."""

    row_id: str
    prompt_len: int
    predicted_remaining: int = 0
    preemptions: int = 0
    planned_remaining: int = 0  # tokens memory planning still reserves (upper quantile), for fits
    computed: int = 0  # KV entries written (prefilled prompt tokens + decoded tokens)
    priority: int = 0  # its request's priority: evictions take the least urgent level first
    pages: list[int] = field(default_factory=list)

    @property
    def prefill_left(self) -> int:
        return max(0, self.prompt_len - self.computed)


@dataclass
class StepPlan:
    """What the executor runs this step: prefill chunks (row id, start, length) and decode rows."""

    prefill: list[tuple[str, int, int]] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    # each evicted row's pages and written KV count, read before the step's forward overwrites
    # them (a swap copies them out to the host pool)
    victims: dict[str, tuple[list[int], int]] = field(default_factory=dict)


class PagePool:
    """A fixed pool of page ids; ``take`` fails (returns None) rather than growing the pool."""

    def __init__(self, num_pages: int) -> None:
        self.free: deque[int] = deque(range(num_pages))
        self.num_pages = num_pages

    def take(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        return [self.free.popleft() for _ in range(n)]

    def give(self, pages: list[int]) -> None:
        self.free.extend(pages)


class RowBook:
    """Rows running on one worker instance and the pages they hold.

    ``admit`` takes a whole admission group only when its prompts' pages fit beside the running
    rows (a batch joins as a unit, as the batcher planned it); ``plan_step`` spends the per-step
    token budget on decode rows first (one token each, so decoding never stalls behind a long
    prompt), then on prefill chunks in admission order, and evicts by ``eviction_order`` when a
    decode row needs a page the pool does not have.
    """

    def __init__(self, num_pages: int, page_size: int = 16, token_budget: int = 512,
                 max_preemptions: int = 8, max_rows: int = DEFAULT_MAX_ROWS, marginal_cost: float = 0.0,
                 step_cost: OnlineStepCost | None = None) -> None:
        self.pool = PagePool(num_pages)
        self.page_size, self.token_budget, self.max_preemptions = page_size, token_budget, max_preemptions
        self.max_rows = max_rows  # most rows running at once (COHORT_CONTINUOUS_MAX_ROWS)
        # a row joins while it pays for itself on this instance's own steps (batcher.row_cost,
        # COHORT_CONTINUOUS_MARGINAL_COST); the executor's caller feeds ``step_cost`` each step
        self.marginal_cost = marginal_cost
        self.step_cost = step_cost if step_cost is not None else OnlineStepCost()
        self._cost_logged = False
        self.rows: dict[str, BookRow] = {}  # insertion order = admission order

    @property
    def free_tokens(self) -> int:
        """KV tokens still free (what the instance publishes so the batcher can send more)."""
        return len(self.pool.free) * self.page_size

    def block_table(self, row_id: str) -> list[int]:
        return list(self.rows[row_id].pages)

    def admit(self, group: list[BookRow]) -> bool:
        """Reserve pages for every prompt of the group, or for none of them."""
        need = sum(pages_for(r.prompt_len, self.page_size) for r in group)
        pages = self.pool.take(need)
        if pages is None:
            return False
        for r in group:
            n = pages_for(r.prompt_len, self.page_size)
            r.pages, pages = pages[:n], pages[n:]
            self.rows[r.row_id] = r
        return True

    def release(self, row_id: str) -> BookRow:
        """The row finished or was cancelled: its pages go back to the pool now."""
        row = self.rows.pop(row_id)
        self.pool.give(row.pages)
        row.pages = []
        return row

    def _grow(self, row: BookRow, plan: StepPlan) -> bool:
        """Give ``row`` room for one more KV entry, evicting others if needed; False if ``row`` itself went."""
        while pages_for(row.computed + 1, self.page_size) > len(row.pages):
            got = self.pool.take(1)
            if got is not None:
                row.pages += got
                continue
            ids = least_urgent({i: r.priority for i, r in self.rows.items()})
            order = eviction_order([self.rows[i].predicted_remaining for i in ids],
                                   [self.rows[i].preemptions for i in ids], self.max_preemptions)
            victim = ids[order[0]]
            plan.victims[victim] = (list(self.rows[victim].pages), self.rows[victim].computed)
            self.release(victim)
            plan.evicted.append(victim)
            if victim == row.row_id:
                return False
        return True

    def plan_step(self, skip: frozenset[str] | set[str] = frozenset()) -> StepPlan:
        """Decide this step's work within the token budget; rows in ``skip`` (yielding to more
        urgent ones, ``batcher.row_priority``) keep their pages but neither decode nor prefill."""
        plan = StepPlan()
        budget = self.token_budget
        for row in [r for r in self.rows.values() if r.prefill_left == 0 and r.row_id not in skip]:
            if budget == 0:
                break
            if row.row_id in self.rows and self._grow(row, plan):
                plan.decode.append(row.row_id)
                budget -= 1
        for row in [r for r in self.rows.values() if r.prefill_left > 0 and r.row_id not in skip]:
            if budget == 0:
                break
            n = min(row.prefill_left, budget)
            plan.prefill.append((row.row_id, row.computed, n))
            budget -= n
        if plan.evicted:  # a row planned to decode may have been evicted for a later one
            plan.decode = [r for r in plan.decode if r in self.rows]
        return plan

    def fits(self, joining: list[tuple[int, int]]) -> bool:
        """May ``joining`` rows ((context, planned remaining) each) join the running ones
        (``batcher.elastic.running_set_fits``)? An empty book takes any group: rows whose prompt
        alone outgrows the pool are failed by the caller."""
        if not self.rows:
            return True
        ctx = [r.prompt_len + max(0, r.computed - r.prompt_len) for r in self.rows.values()]
        rem = [r.planned_remaining for r in self.rows.values()]
        return running_set_fits(ctx + [c for c, _ in joining], rem + [g for _, g in joining], self.page_size,
                                self.capacity_tokens, self.max_rows, self.step_cost, self.marginal_cost)

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """The executor ran ``plan`` (not committed yet) in ``seconds``: teach the step cost its
        tokens and the context they attended to (each decode row its own, each prefill chunk its
        row's cache up to the chunk's end). Nothing to learn while the rule is off: no one reads it,
        and this runs on the decode thread every step."""
        if not self.marginal_cost:
            return
        prefill = sum(n for _r, _s, n in plan.prefill)
        kv = sum(self.rows[r].computed + 1 for r in plan.decode if r in self.rows)
        kv += sum(start + n for _r, start, n in plan.prefill)
        self.step_cost.observe(len(plan.decode), prefill, kv, seconds)
        if not self._cost_logged and (coef := self.step_cost.coefficients) is not None:
            self._cost_logged = True
            a, b, p, c = coef
            most = next((n for n in range(2, self.max_rows + 1)
                         if not row_pays(self.step_cost, n, n * 256, self.marginal_cost)), None)
            log.info("step cost learnt from %d steps: %.2f ms + %.4f ms per decode row + %.4f ms per prefill "
                     "token + %.3f us per context token; rows of 256-token context pay for themselves up to %s",
                     self.step_cost.steps, a * 1e3, b * 1e3, p * 1e3, c * 1e6,
                     most - 1 if most else f"the row cap ({self.max_rows})")

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_pages * self.page_size

    def commit(self, plan: StepPlan) -> None:
        """The executor ran ``plan``: advance each row's written KV count."""
        for row_id, _start, n in plan.prefill:
            self.rows[row_id].computed += n
        for row_id in plan.decode:
            if row_id in self.rows:
                self.rows[row_id].computed += 1
