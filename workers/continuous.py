"""Continuous execution (``COHORT_EXECUTION=continuous``): batches schedule, rows run.

The batcher still forms and orders batches with its policy; here a batch is an *admission
group*. One ``ContinuousRun`` holds an instance's running rows in a page pool (``RowBook`` +
``PagedExecutor``: packed, unpadded prefill in chunks under a per-step token budget, decode
attending each row to its own context) and, at every step boundary:

1. drops cancelled rows (their pages return at once);
2. admits waiting work in order — rows it preempted first (recompute: prompt + generated tokens
   are prefilled again, their tokens kept), then the groups the batcher sent — while its KV plan
   fits beside the running rows (``RowBook.fits``: the planned peak — each row's context plus its
   upper-quantile remaining length, rows leaving as they finish — within the pool, at most
   ``COHORT_CONTINUOUS__MAX_ROWS`` rows, and the last one still paying for itself on this
   instance's own measured steps, ``COHORT_CONTINUOUS__MARGINAL_COST``). An
   empty instance always takes the head of the queue, so a plan that over-reserves never stalls;
3. runs one packed forward and hands each row that produced a token to ``workers.rows`` (the
   same sampling, token limits and logprobs as the padded paths); the step's ``TokenEvent``s are
   rendered into text off this thread (``workers.row_text``: stop strings, deltas, answers), and
   a row a stop string ended comes back as a cancel;
4. evicts by ``batcher.elastic.eviction_order`` when a decoding row needs a page the pool does
   not have (and, on CUDA, when the step itself runs out of memory): the victim waits here and
   resumes first, so its client sees one answer and its group stays whole.

``step`` returns each touched group's ``StepOutput``; a group is over when none of its rows is
left (``finished_groups``). Plain step machine, no threads: ``workers.continuous_loop`` drives it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from batcher.preemption import SwapLink, choose_preemption, swap_seconds
from batcher.prefix_pages import page_hashes
from batcher.row_priority import StepShares
from batcher.running_set import Admission, RunningSet, RunRow, StepPlan
from cohort.continuous_knobs import ContinuousSettings
from cohort.protocol import FailureCode, FinishReason
from cohort.settings import PreemptionMode
from cohort.types import Batch
from workers.paged_attention import context_slots
from workers.paged_executor import PagedExecutor
from workers.prompt_logprobs import prompt_logprobs
from workers.rows import RowState, TokenStepper
from workers.step_outputs import StepOutput
from workers.swap_pool import HostSwapPool

PreemptionChoice = Literal["swap", "recompute"]


@dataclass
class SwapPlan:
    """How this instance gives back an evicted row's KV: the mode, the host pool, the measured
    link and what a recompute costs here: ``recompute_cost(tokens, running_rows)`` (the fitted
    model's marginal packed prefill, ``predictor.recompute_cost``) where the worker has one, else
    the prefill cost per token measured at start."""

    mode: PreemptionMode
    pool: HostSwapPool
    link: SwapLink
    delta_bytes: int
    prefill_s_per_token: float
    recompute_cost: Callable[[int, int], float] | None = None

    def recompute_seconds(self, tokens: int, running_rows: int) -> float:
        if self.recompute_cost is not None:
            return self.recompute_cost(tokens, running_rows)
        return tokens * self.prefill_s_per_token

    def choose(self, kv_tokens: int, recompute_tokens: int, running_rows: int = 0) -> PreemptionChoice:
        return choose_preemption(self.mode, swap_seconds(kv_tokens, self.delta_bytes, self.link),
                                 self.recompute_seconds(recompute_tokens, running_rows), self.pool.free_tokens,
                                 kv_tokens)

log = logging.getLogger(__name__)
DEFAULT_MAX_ROWS = ContinuousSettings.model_fields["max_rows"].default  # vLLM's max_num_seqs
MIN_STEP_TOKENS = 16  # the smallest per-step token budget a CUDA out-of-memory error halves it to


@dataclass
class Group:
    """One admission group (a batch the batcher sent) while any of its rows is here."""

    batch: Batch
    rows: dict[str, RowState]
    admitted_at: float | None = None
    left: set[str] = field(default_factory=set)  # row ids still running or waiting

    @property
    def generated(self) -> int:
        """Tokens its rows generated here (evicted and resumed rows keep theirs)."""
        return sum(len(r.new_ids) for r in self.rows.values())


class ContinuousRun:
    """One instance's running set on a model: submit groups, ``step`` until ``idle``. Who waits,
    joins, runs and is evicted is ``batcher.running_set``'s (the simulator drives the same class);
    this drives the hardware (packed forward, CUDA sync and out-of-memory retry, swap) and routes
    each row's tokens and failures to its group."""

    def __init__(self, model, tokenizer, device: torch.device, dtype: torch.dtype, *, num_pages: int,
                 page_size: int = 16, token_budget: int = 512, max_preemptions: int = 8, emulate: bool = False,
                 clock: Callable[[], float] = time.time, swap: SwapPlan | None = None,
                 shares: StepShares | None = None, max_rows: int = DEFAULT_MAX_ROWS, marginal_cost: float = 0.0,
                 prefix_salt: str | None = None) -> None:
        self.book = RunningSet(num_pages, page_size, token_budget, max_preemptions, max_rows, marginal_cost,
                               prefix_caching=prefix_salt is not None)
        self.prefix_salt = prefix_salt  # the model (and adapter) prompt pages are keyed under; None: no cache
        self.executor = PagedExecutor(model, self.book, dtype, device)
        self.swap = swap
        self.shares = shares or StepShares()    # background rows give way (batcher.row_priority)
        self.swaps = 0                          # evictions that went to the host pool
        self.ooms = 0                           # CUDA out-of-memory errors caught inside a step
        self.tok, self.device, self.emulate, self.clock = tokenizer, device, emulate, clock
        self.stepper = TokenStepper(tokenizer, clock=clock)  # tokens only: the text is the consumer's
        self.groups: dict[str, Group] = {}
        self.group_of: dict[str, str] = {}      # row id -> batch id
        self.ids: dict[str, list[int]] = {}     # row id -> prompt + generated ids (what the executor reads)
        self._prompt_logits: dict[str, list[torch.Tensor]] = {}
        self.cached_tokens: dict[str, int] = {}  # row id -> prompt tokens reused at its first prefill
        self._cancelled: set[str] = set()
        self.just_admitted: list[str] = []      # batch ids admitted by the last step
        self.steps, self.busy_s, self.row_steps = 0, 0.0, 0  # steps run, their seconds, Σ rows per step

    @property
    def evictions(self) -> int:
        """Rows evicted for pages (each resumed by swap or recompute)."""
        return self.book.evictions

    # --- the outside ----------------------------------------------------------------------
    def submit(self, batch: Batch, prompt_ids: Sequence[list[int]]) -> None:
        """Queue a group for admission (a redelivered batch already here is ignored)."""
        if batch.id in self.groups:
            return
        rows = {}
        for req, ids in zip(batch.requests, prompt_ids, strict=True):
            if req.id in self.group_of:  # the same request twice: answered by its first copy
                log.warning("request %s is already running here; batch %s skips it", req.id, batch.id)
                continue
            rows[req.id] = RowState(req, list(ids), self.emulate)
        self.groups[batch.id] = Group(batch, rows, left=set(rows))
        for rid, row in rows.items():
            self.group_of[rid] = batch.id
            self.ids[rid] = row.all_ids
        self.book.add_group(batch.id, [RunRow(rid, len(self.ids[rid]), predicted_remaining=row.predicted_remaining,
                                              planned_remaining=row.planned_remaining, preemptions=row.req.preemptions,
                                              priority=row.req.priority, hashes=self._hashes(rid),
                                              cacheable=row.prompt_top is None) for rid, row in rows.items()])

    def _hashes(self, rid: str) -> list[int]:
        if self.prefix_salt is None:
            return []
        return page_hashes(self.ids[rid], self.book.page_size, self.prefix_salt)

    def cancel(self, request_ids: Iterable[str]) -> None:
        """Drop these rows at the next step boundary (the client went away)."""
        self._cancelled.update(request_ids)

    @property
    def idle(self) -> bool:
        return not self.groups

    def alive_ids(self, batch_id: str) -> list[str]:
        g = self.groups.get(batch_id)
        return sorted(g.left) if g else []

    def finished_groups(self) -> list[Group]:
        """Groups with no row left, removed from the run."""
        done = [g for g in self.groups.values() if not g.left]
        for g in done:
            del self.groups[g.batch.id]
            self.book.waiting.pop(g.batch.id, None)
        return done

    # --- one step: schedule, execute, update -----------------------------------------------
    @torch.inference_mode()
    def step(self) -> dict[str, StepOutput]:
        out = StepOutput()
        self._drop_cancelled()
        running = self.shares.running(self._prio(rid) for g in self.groups.values() for rid in g.left)
        self._admitted(self.book.admit_waiting(running), out)
        while True:
            plan = self.book.plan_step(self._paused(running))
            self._evicted(plan, out)
            hooked = {rid for rid in self._prompt_logits}
            try:
                t0 = time.perf_counter()
                logits = self.executor.run(plan, self.ids, self._hook, hooked) if plan.prefill or plan.decode else {}
                if self.device.type == "cuda":  # the kernels run after launch: time the step, not its launch
                    torch.cuda.synchronize(self.device)  # (sampling waits for them next anyway)
                spent = time.perf_counter() - t0
                self.steps += 1
                self.busy_s += spent
                self.row_steps += len(plan.decode) + len(plan.prefill)
                self.book.observe(plan, spent)
                self.shares.observe(spent, {self._prio(r) for r in [*plan.decode, *(p[0] for p in plan.prefill)]})
                break
            except torch.cuda.OutOfMemoryError as e:  # the safety net under the page pool
                self._out_of_memory(plan, out, e)
        ready = self.book.commit(plan)
        if ready:
            self._accept(ready, logits, out)
        return self._route(out)

    def _out_of_memory(self, plan: StepPlan, out: StepOutput, e: Exception) -> None:
        """A step's activations did not fit beside the page pool (nothing was committed; the
        slots it wrote are rewritten by the retry): smaller prefill chunks first, then the newest
        row waits and resumes, and a row that cannot run even alone fails explicitly."""
        torch.cuda.empty_cache()
        self.ooms += 1
        if plan.prefill and self.book.token_budget > MIN_STEP_TOKENS:
            self.book.token_budget = max(MIN_STEP_TOKENS, self.book.token_budget // 2)
            log.warning("CUDA out of memory in a step (%s): %d tokens per step from now on", e, self.book.token_budget)
            return
        newest = next(reversed(self.book.rows), None)
        if newest is None:
            raise e
        if len(self.book.rows) == 1:
            self.book.release(newest)
            self._fail(newest, out, f"this request does not fit the device's memory even alone ({e}); "
                       "shorten the input or lower max_tokens")
            return
        log.warning("CUDA out of memory in a step (%s): row %s waits and resumes", e, newest)
        shed = StepPlan()
        self.book.evict(newest, shed)
        self._evicted(shed, out)

    def _drop_cancelled(self) -> None:
        for rid in list(self._cancelled):
            self._cancelled.discard(rid)
            if rid in self.group_of:
                self.book.cancel(rid)
                self._forget(rid)

    def _forget(self, rid: str) -> None:
        """The row is over here (answered, failed, cancelled): its group stops waiting for it."""
        bid = self.group_of.pop(rid)
        self.groups[bid].left.discard(rid)
        self.ids.pop(rid, None)
        self._prompt_logits.pop(rid, None)
        self.cached_tokens.pop(rid, None)
        if self.swap is not None:
            self.swap.pool.drop(rid)

    def _prio(self, rid: str) -> int:
        return self.groups[self.group_of[rid]].rows[rid].req.priority

    def _paused(self, running: set[int]) -> set[str]:
        """Resident rows whose level yields this step; none while no resident row runs (the urgent
        rows wait for pages: the others go on and free them rather than stall)."""
        paused = {rid for rid in self.book.rows if self._prio(rid) not in running}
        return set() if len(paused) == len(self.book.rows) else paused

    def _admitted(self, adm: Admission, out: StepOutput) -> None:
        """What the step boundary let in: resumed rows get their KV back from the host pool when
        they were swapped out; admitted groups start their clocks; rows too long even alone fail."""
        self.just_admitted = list(adm.groups)
        for rid, _why in adm.failed:
            self._fail(rid, out, f"its prompt of {len(self.ids[rid])} tokens alone exceeds the instance's KV "
                       f"memory ({self.book.capacity_tokens} tokens); shorten the input")
        for rid in adm.resumed:
            row = self.book.rows[rid]
            if self.swap is not None and rid in self.swap.pool.rows:  # its KV comes back from the host
                slots = context_slots(torch.tensor(row.pages, device=self.device), row.prompt_len, self.book.page_size)
                row.computed = self.swap.pool.swap_in(rid, self.executor.store, slots)
        now = self.clock()
        for bid in adm.groups:
            g = self.groups[bid]
            g.admitted_at = now
            for rid in g.left:
                if g.rows[rid].prompt_top is not None:
                    self._prompt_logits[rid] = []

    def _hook(self, rid: str, _first: int, logits: torch.Tensor) -> None:
        self._prompt_logits[rid].append(logits.float())

    def _evicted(self, plan: StepPlan, out: StepOutput) -> None:
        """Pages gone: each victim keeps its tokens (streamed now) and resumes first, its KV either
        copied back from the host pool (swap) or prefilled again (recompute), whichever
        ``batcher.preemption.choose_preemption`` predicts cheaper under ``COHORT_PREEMPTION``; one
        that no longer fits even alone fails."""
        outgrew = {rid for rid, _why in plan.failed}
        for rid in plan.evicted:
            pages, computed = plan.victims[rid]
            out.preempted.append(rid)
            if rid in outgrew:
                row = self.groups[self.group_of[rid]].rows[rid]
                self._fail(rid, out, f"this request alone outgrows the instance's KV memory after {row.total_tokens} "
                           f"generated tokens ({self.book.capacity_tokens} tokens); lower max_tokens or shorten "
                           "the input")
                continue
            # the victim rejoins the rows still running: its recompute is priced beside them
            swapped = (self.swap is not None and computed > 0
                       and self.swap.choose(computed, len(self.ids[rid]), len(self.book.rows)) == "swap")
            if swapped:
                slots = context_slots(torch.tensor(pages, device=self.device), computed, self.book.page_size)
                self.swap.pool.swap_out(rid, self.executor.store, slots)
                self.book.mark_swapped(rid)
                self.swaps += 1
                out.swapped.append(rid)
            elif rid in self._prompt_logits:
                self._prompt_logits[rid] = []  # its prompt is prefilled again from the start

    def _fail(self, rid: str, out: StepOutput, message: str) -> None:
        row = self.groups[self.group_of[rid]].rows[rid]
        out.failed.append((row.req, FailureCode.OUT_OF_MEMORY, message))
        row.done = FinishReason.LENGTH
        self._forget(rid)

    def _accept(self, ready: list[str], logits: dict[str, torch.Tensor], out: StepOutput) -> None:
        rows = [self.groups[self.group_of[rid]].rows[rid] for rid in ready]
        for rid, row in zip(ready, rows, strict=True):
            chunks = self._prompt_logits.pop(rid, None)
            if chunks is not None and row.prompt_top is not None:
                seq = self.ids[rid]
                out.prompt_scores.append((row.req, list(seq), prompt_logprobs(torch.cat(chunks)[:-1], seq,
                                                                              row.prompt_top)))
                row.prompt_top = None
        before = [len(r.new_ids) for r in rows]
        for rid in ready:
            self.cached_tokens.setdefault(rid, self.book.rows[rid].cached)
        events = len(out.tokens)
        self.stepper.accept(rows, torch.stack([logits[rid] for rid in ready]), out)
        for ev in out.tokens[events:]:  # the usage and the log DB report what the cache served
            ev.cached_tokens = self.cached_tokens.get(ev.req.id, 0)
        for rid, row, n in zip(ready, rows, before, strict=True):
            if row.done is not None:
                self.book.release(rid)
                self._forget(rid)
                continue
            if len(row.new_ids) > n:
                self.ids[rid].append(row.new_ids[-1])
                self.book.produced(rid, row.predicted_remaining, row.planned_remaining)
            else:
                b = self.book.rows[rid]
                b.predicted_remaining, b.planned_remaining = row.predicted_remaining, row.planned_remaining

    def _route(self, out: StepOutput) -> dict[str, StepOutput]:
        """Split one step's output by the group each row belongs to."""
        by: dict[str, StepOutput] = {}
        owner = {rid: bid for bid, g in self.groups.items() for rid in g.rows} if (
            out.tokens or out.failed or out.prompt_scores or out.preempted) else {}

        def put(rid: str) -> StepOutput:
            return by.setdefault(owner[rid], StepOutput())

        for ev in out.tokens:
            put(ev.req.id).tokens.append(ev)
        for f in out.failed:
            put(f[0].id).failed.append(f)
        for p in out.prompt_scores:
            put(p[0].id).prompt_scores.append(p)
        for rid in out.preempted:
            put(rid).preempted.append(rid)
        for rid in out.swapped:
            put(rid).swapped.append(rid)
        for bid in self.just_admitted:
            by.setdefault(bid, StepOutput())
        return by
