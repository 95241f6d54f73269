"""One continuous instance's running set: who waits, who joins, who runs this step, who is evicted.

Plain Python, no torch: the live worker's engine (``workers.continuous``: schedule → execute →
update) and the simulator's (``bench.group_engine``) drive this one class unchanged, so both admit
and evict the same rows on the same trace, and it is tested from hand-built rows without a model.

KV lives in fixed-size pages from a preallocated pool: a growing row takes one more page id, a row
that leaves returns its pages at once, which is what lets the next admission group join mid-batch.
At a step boundary (``admit_waiting``) rows this instance evicted resume first, then the batches the
batcher sent join as whole *admission groups* in its order (most urgent priority first), while the
KV judge (``batcher.kv_judge``) lets the running rows plus the group run together; an empty
instance takes any group. ``plan_step`` spends the per-step token budget on decoding rows first
(one token each, so decoding never stalls behind a long prompt), then on prefill chunks in
admission order, and evicts by ``batcher.elastic.eviction_order`` (least urgent level first) when a
decoding row needs a page the pool does not have: the victim keeps its tokens and waits here to
resume before anything new joins. Rows that cannot run even alone are handed back as ``failed``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from batcher.elastic import eviction_order
from batcher.kv_judge import KVJudge, pages_for
from batcher.page_pool import PagePool
from batcher.row_cost import OnlineStepCost, row_pays
from batcher.row_priority import least_urgent

log = logging.getLogger(__name__)

TOO_LONG = "prompt"        # failed: its prompt alone exceeds the instance's KV pages
OUTGREW = "outgrew"        # failed: evicted while alone, it no longer fits even alone


@dataclass
class RunRow:
    """One row's scheduling record while it is on this instance (waiting, running or resuming)."""

    row_id: str
    prompt_len: int                 # tokens to prefill in this residency (prompt + generated when resumed)
    group_id: str = ""
    predicted_remaining: int = 0
    planned_remaining: int = 0      # tokens memory planning still reserves (upper quantile)
    preemptions: int = 0
    priority: int = 0               # its request's priority: evictions take the least urgent level first
    computed: int = 0               # KV entries written (prefilled tokens + decoded tokens)
    tokens: int = -1                # prompt + generated ids; -1: prompt_len
    pages: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)   # its prompt's full pages (batcher.prefix_pages)
    cacheable: bool = True          # may reuse cached pages (not when its prompt's logprobs are asked for)
    swapped: bool = False           # evicted to the host pool: it comes back with its own KV, not the cache's
    cached: int = 0                 # prompt tokens this residency reused from the prefix cache

    def __post_init__(self) -> None:
        if self.tokens < 0:
            self.tokens = self.prompt_len

    @property
    def prefill_left(self) -> int:
        return max(0, self.prompt_len - self.computed)

    @property
    def context(self) -> int:
        """KV entries this row holds once prefilled, plus those it decoded since."""
        return max(self.prompt_len, self.computed)


@dataclass
class StepPlan:
    """What the executor runs this step: prefill chunks (row id, start, length) and decode rows."""

    prefill: list[tuple[str, int, int]] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    evicted: list[str] = field(default_factory=list)
    # each evicted row's pages and written KV count, read before the step's forward overwrites
    # them (a swap copies them out to the host pool)
    victims: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    failed: list[tuple[str, str]] = field(default_factory=list)   # (row id, TOO_LONG | OUTGREW)


@dataclass
class Admission:
    """What one step boundary let in: whole groups, resumed rows, and rows failed as too long."""

    groups: list[str] = field(default_factory=list)
    resumed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)


class RunningSet:
    """Rows on one instance: ``add_group`` → (each step) ``admit_waiting``, ``plan_step``, ``commit``,
    ``produced`` / ``release``. ``rows`` are the resident ones in admission order."""

    def __init__(self, num_pages: int, page_size: int = 16, token_budget: int = 512, max_preemptions: int = 8,
                 max_rows: int = 256, marginal_cost: float = 0.0, step_cost: OnlineStepCost | None = None,
                 prefix_caching: bool = True) -> None:
        self.pool = PagePool(num_pages, prefix_caching)
        self.page_size, self.token_budget, self.max_preemptions = page_size, token_budget, max_preemptions
        self.judge = KVJudge(num_pages * page_size, page_size, max_rows, marginal_cost)
        self.step_cost = step_cost if step_cost is not None else OnlineStepCost()
        self._cost_logged = False
        self.rows: dict[str, RunRow] = {}               # resident, insertion order = admission order
        self.waiting: dict[str, list[RunRow]] = {}      # group id -> its rows, in the batcher's order
        self.resume: deque[RunRow] = deque()            # evicted here, waiting to be prefilled again
        self.evictions = 0

    # --- what the judge and the executor read ---------------------------------------------
    @property
    def capacity_tokens(self) -> int:
        return self.judge.capacity_tokens

    @property
    def max_rows(self) -> int:
        return self.judge.max_rows

    @property
    def free_tokens(self) -> int:
        """KV tokens still free, cached pages included (what the instance publishes so the batcher can send more)."""
        return self.pool.available * self.page_size

    def block_table(self, row_id: str) -> list[int]:
        return list(self.rows[row_id].pages)

    def fits(self, joining: list[tuple[int, int]]) -> bool:
        """May ``joining`` rows ((context, planned remaining) each) join the resident ones? An
        empty instance takes any group (rows too long even alone are failed at admission)."""
        if not self.rows:
            return True
        ctx = [r.context for r in self.rows.values()] + [c for c, _ in joining]
        rem = [r.planned_remaining for r in self.rows.values()] + [g for _, g in joining]
        return self.judge.running_set_fits(ctx, rem, self.step_cost)

    # --- the outside ----------------------------------------------------------------------
    def add_group(self, group_id: str, rows: list[RunRow]) -> None:
        """Queue an admission group (in the batcher's order); a group id already here is ignored."""
        if group_id in self.waiting:
            return
        for r in rows:
            r.group_id = group_id
        self.waiting[group_id] = rows

    def cancel(self, row_id: str) -> RunRow | None:
        """Drop the row wherever it is (its pages return now); None when it is not here."""
        if row_id in self.rows:
            return self.release(row_id)
        for r in self.resume:
            if r.row_id == row_id:
                self.resume.remove(r)
                return r
        for gid, rows in self.waiting.items():
            for r in rows:
                if r.row_id == row_id:
                    rows.remove(r)
                    if not rows:
                        del self.waiting[gid]
                    return r
        return None

    def release(self, row_id: str) -> RunRow:
        """The row finished, failed or was cancelled: its pages go back to the pool now."""
        row = self.rows.pop(row_id)
        self.pool.give(row.pages)
        row.pages = []
        return row

    def produced(self, row_id: str, predicted_remaining: int, planned_remaining: int) -> None:
        """The row's step gave it one more token (not yet in KV: the next step writes it)."""
        row = self.rows[row_id]
        row.tokens += 1
        row.predicted_remaining, row.planned_remaining = predicted_remaining, planned_remaining

    @property
    def idle(self) -> bool:
        return not (self.rows or self.waiting or self.resume)

    # --- a step boundary ------------------------------------------------------------------
    def _reusable(self, row: RunRow) -> Sequence[int]:
        """The prompt page hashes ``row`` may look up: none when it may not reuse, and never its whole
        prompt (its last token is prefilled here, for the logits of its next token)."""
        if not row.cacheable or row.swapped:
            return ()
        return row.hashes[:max(0, (row.prompt_len - 1) // self.page_size)]

    def admit(self, rows: list[RunRow]) -> bool:
        """Make these rows resident now, or none of them: each reuses the cached pages of its
        prompt's longest cached prefix and takes pages for the rest (the step boundary's
        ``admit_waiting`` calls it; so does the worker's start-up profile)."""
        hits = [self.pool.lookup(self._reusable(r)) for r in rows]
        for h in hits:
            self.pool.hold(h)            # before taking: a page about to be reused is not reclaimed
        pages = self.pool.take(sum(pages_for(r.prompt_len, self.page_size) - len(h) for r, h in zip(rows, hits, strict=True)))
        if pages is None:
            for h in hits:
                self.pool.give(h)
            return False
        for r, h in zip(rows, hits, strict=True):
            n = pages_for(r.prompt_len, self.page_size) - len(h)
            r.pages, pages = [*h, *pages[:n]], pages[n:]
            r.computed = r.cached = len(h) * self.page_size
            r.swapped = False
            self.pool.queries += r.prompt_len
            self.pool.hits += r.cached
            self.rows[r.row_id] = r
        return True

    def _joining_context(self, row: RunRow, seen: set[int]) -> int:
        """The KV ``row`` adds to the pool: its prompt less the leading pages a resident or an
        earlier joining row holds already (a shared page counts once)."""
        shared = 0
        for h in self._reusable(row):
            if h not in seen:
                break
            shared += 1
        return max(1, row.prompt_len - shared * self.page_size)

    def admit_waiting(self, running: set[int] | None = None) -> Admission:
        """Resumed rows of the levels running this step (``None``: all), then waiting groups, most
        urgent first, while they fit beside the resident rows. A group of a yielding level joins
        too and waits resident: one held here would hold up the batcher. Stops at the first that
        does not fit, so nothing overtakes a resumed row or the batcher's order."""
        out = Admission()
        if not self.resume and not self.waiting:
            return out   # every step asks: nothing to build while nothing waits
        seen = {h for r in self.rows.values() for h in r.hashes} if self.pool.caching else set()
        for row in [r for r in self.resume if running is None or r.priority in running]:
            if not self.fits([(self._joining_context(row, seen), row.planned_remaining)]) or not self.admit([row]):
                return out
            seen.update(row.hashes)
            self.resume.remove(row)
            out.resumed.append(row.row_id)
        order = sorted(self.waiting, key=lambda g: min((r.priority for r in self.waiting[g]), default=0))
        for gid in order:
            rows = self.waiting[gid]
            for r in [r for r in rows if not self.judge.alone_fits(r.prompt_len + 1)]:
                rows.remove(r)
                out.failed.append((r.row_id, TOO_LONG))
            joining = []
            for r in rows:
                joining.append((self._joining_context(r, seen), r.planned_remaining))
                seen.update(r.hashes)
            if not self.fits(joining) or not self.admit(rows):
                return out
            del self.waiting[gid]
            out.groups.append(gid)
        return out

    def _grow(self, row: RunRow, plan: StepPlan) -> bool:
        """Give ``row`` room for one more KV entry, evicting others if needed; False if ``row`` itself went."""
        while pages_for(row.computed + 1, self.page_size) > len(row.pages):
            got = self.pool.take(1)
            if got is not None:
                row.pages += got
                continue
            ids = least_urgent({i: r.priority for i, r in self.rows.items()})
            order = eviction_order([self.rows[i].predicted_remaining for i in ids],
                                   [self.rows[i].preemptions for i in ids], self.max_preemptions)
            victim = self.rows[ids[order[0]]]
            plan.victims[victim.row_id] = (list(victim.pages), victim.computed)
            self._evict(victim, plan)
            if victim is row:
                return False
        return True

    def _evict(self, row: RunRow, plan: StepPlan) -> None:
        """Out of the pool, first in line to come back; its tokens so far are its next prompt."""
        self.release(row.row_id)
        plan.evicted.append(row.row_id)
        self.evictions += 1
        row.preemptions += 1
        row.prompt_len, row.computed = row.tokens, 0
        if not self.rows and not self.judge.alone_fits(row.prompt_len + 1):
            plan.failed.append((row.row_id, OUTGREW))
        else:
            self.resume.append(row)

    def mark_swapped(self, row_id: str) -> None:
        """The evicted row's KV went to the host pool: it resumes with it, not with cached pages."""
        for r in self.resume:
            if r.row_id == row_id:
                r.swapped = True

    def evict(self, row_id: str, plan: StepPlan) -> None:
        """The executor could not run a step (a CUDA out-of-memory error): this row waits and resumes."""
        row = self.rows[row_id]
        plan.victims[row_id] = (list(row.pages), row.computed)
        self._evict(row, plan)

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
        writing = self._pages_being_written()
        for row in [r for r in self.rows.values() if r.prefill_left > 0 and r.row_id not in skip]:
            if budget == 0:
                break
            if not self._catch_up(row, writing):
                continue
            n = min(row.prefill_left, budget)
            plan.prefill.append((row.row_id, row.computed, n))
            budget -= n
        if plan.evicted:  # a row planned to decode may have been evicted for a later one
            plan.decode = [r for r in plan.decode if r in self.rows]
        return plan

    def _pages_being_written(self) -> dict[int, str]:
        """Prompt page hash -> the first resident row (admission order) still to write that page."""
        writing: dict[int, str] = {}
        if self.pool.caching:
            for r in self.rows.values():
                if r.prefill_left > 0:
                    for h in r.hashes[r.computed // self.page_size:]:
                        writing.setdefault(h, r.row_id)
        return writing

    def _catch_up(self, row: RunRow, writing: dict[int, str]) -> bool:
        """Before a row prefills anything of its own: reuse what was cached since it joined (the
        other choices of its request, or a request with the same prompt admitted just before it), and
        wait (False) while an earlier row is still writing the next page it could reuse."""
        if row.computed != row.cached:
            return True   # it prefills its own pages already: nothing to reuse any more
        want = self._reusable(row)
        k = row.computed // self.page_size
        hits = self.pool.lookup(want)[k:] if k < len(want) else []
        if hits:
            self.pool.hold(hits)
            self.pool.give(row.pages[k:k + len(hits)])
            row.pages = [*row.pages[:k], *hits, *row.pages[k + len(hits):]]
            row.computed = row.cached = (k + len(hits)) * self.page_size
            self.pool.hits += len(hits) * self.page_size
            k += len(hits)
        owner = writing.get(want[k]) if k < len(want) else None
        return owner is None or owner == row.row_id

    def commit(self, plan: StepPlan) -> list[str]:
        """The executor ran ``plan``: advance each row's written KV count; returns the rows that
        now produce a token (their prefill completed, or they decoded)."""
        ready = []
        for row_id, start, n in plan.prefill:
            row = self.rows[row_id]
            row.computed += n
            for k in range(start // self.page_size, min(row.computed // self.page_size, len(row.hashes))):
                self.pool.cache(row.pages[k], row.hashes[k])   # a full prompt page is written: reusable
            if row.prefill_left == 0:
                ready.append(row_id)
        for row_id in plan.decode:
            if row_id in self.rows:
                self.rows[row_id].computed += 1
                ready.append(row_id)
        return ready

    def observe(self, plan: StepPlan, seconds: float) -> None:
        """The executor ran ``plan`` (not committed yet) in ``seconds``: teach the step cost its
        tokens and the context they attended to (each decode row its own, each prefill chunk its
        row's cache up to the chunk's end). Nothing to learn while the rule is off: no one reads it,
        and this runs on the decode thread every step."""
        if not self.judge.marginal_cost:
            return
        prefill = sum(n for _r, _s, n in plan.prefill)
        kv = sum(self.rows[r].computed + 1 for r in plan.decode if r in self.rows)
        kv += sum(start + n for _r, start, n in plan.prefill)
        self.step_cost.observe(len(plan.decode), prefill, kv, seconds)
        if not self._cost_logged and (coef := self.step_cost.coefficients) is not None:
            self._cost_logged = True
            a, b, p, c = coef
            most = next((n for n in range(2, self.max_rows + 1)
                         if not row_pays(self.step_cost, n, n * 256, self.judge.marginal_cost)), None)
            log.info("step cost learnt from %d steps: %.2f ms + %.4f ms per decode row + %.4f ms per prefill "
                     "token + %.3f us per context token; rows of 256-token context pay for themselves up to %s",
                     self.step_cost.steps, a * 1e3, b * 1e3, p * 1e3, c * 1e6,
                     most - 1 if most else f"the row cap ({self.max_rows})")
