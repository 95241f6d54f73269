"""Step-level simulation of continuous execution: rows join at step boundaries and leave as they finish.

One instance holds a running set of rows in a KV pool of fixed-size pages (16 tokens). Every
step (iteration) it

1. gives each running row its tokens for this step under a per-step token budget
   (``max_batched_tokens``): 1 for a decoding row, the next chunk of its prompt for a row still
   prefilling (chunked prefill: a long prompt does not stall the decoding rows);
2. when a row's new tokens need a page and none is free, preempts rows (the scheduler's victim,
   by recompute: its KV is dropped and it comes back as a continuation that prefills prompt +
   generated tokens again) until they fit;
3. if nothing was preempted, admits new rows (the scheduler's admission rule) into the budget
   left;
4. costs the step with the roofline's unpadded step (``RooflineBatchTime.step_seconds``): each
   row's own prompt tokens and its own context, nothing padded to a batch's longest member.

Preemption (``preemption``, AdaptiveLLM §3.3, ``batcher.preemption``): a victim is recomputed
(KV dropped, it re-enters the scheduler as a continuation) or swapped (its pages move to the
instance's host pool over the GPU preset's PCIe link and it waits in the instance's *swapped* set,
keeping its tokens; bringing it back costs the same bytes the other way). Transfers are
synchronous: they lengthen the step that makes them. The recompute cost the rule compares against
is the row's marginal cost inside a step of the rows running beside it (``_recompute_s``): cohort
re-prefills inside the running batch, not as a lone prefill. At a step boundary the
scheduler says whether the swapped set or the waiting queue goes (``swap_in_first``; never both).

A row whose prompt completes in a step produces its first token at the end of that step, then one
token per step; it leaves (answered, pages freed) the step it reaches its true length.

Schedulers (``bench.continuous_sched``): ``cb-fcfs`` behaves like vLLM's default (FCFS over
requests, admit while pages are free, preempt the newest), and cohort's policies, where a batch
formed by the policy is an *admission group* taken as soon as its KV plan fits beside the
running rows. The engine itself is pure Python and knows nothing about either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from batcher.preemption import SwapLink, choose_preemption, swap_seconds
from bench.roofline import RooflineBatchTime
from cohort.settings import PreemptionMode
from cohort.types import ProfiledRequest


@dataclass(frozen=True)
class EngineLimits:
    """vLLM's defaults: 16-token pages, 8,192 batched tokens and 256 sequences per step."""

    page_tokens: int = 16
    max_batched_tokens: int = 8192
    max_num_seqs: int = 256
    # False: vLLM 0.2.5 (AdaptiveLLM's base, ``vllm_025``): a step that admits prompts runs only those
    # prompts, whole and padded to the longest (β·max L ≤ max_batched_tokens, at most
    # ``max_paddings`` pad tokens), and every decoding row waits for it; a recompute is then a
    # lone prefill step. A prompt is allocated whole and must leave ``watermark_pages`` free.
    chunked_prefill: bool = True
    max_paddings: int = 256
    watermark_pages: int = 0

    @classmethod
    def vllm_025(cls, gpu_pages: int, max_num_seqs: int = 256, max_model_len: int = 4096) -> EngineLimits:
        """vLLM 0.2.5's defaults (vllm/config.py, core/block_manager.py at v0.2.5): prompt steps of
        max(max_model_len, 2048) padded tokens, 256 pad tokens at most, a 1 % page watermark."""
        return cls(max_batched_tokens=max(max_model_len, 2048), max_num_seqs=max_num_seqs, chunked_prefill=False,
                   max_paddings=256, watermark_pages=int(0.01 * gpu_pages))


class SimRow:
    """One request running on an instance (this run of it: a continuation starts a new row)."""

    __slots__ = ("j", "req", "prompt", "filled", "kv", "gen", "pages", "order")

    def __init__(self, j: int, req: ProfiledRequest, order: int) -> None:
        self.j = j                      # index in the trace
        self.req = req                  # what this run serves (a continuation after a preemption)
        self.prompt = req.input_tokens  # tokens to prefill: the prompt, plus generated ones if resumed
        self.filled = 0                 # prompt tokens already in KV
        self.kv = 0                     # tokens in KV
        self.gen = 0                    # tokens generated in this run
        self.pages = 0
        self.order = order              # admission sequence number (newest = largest)

    @property
    def true_left(self) -> int:
        return int(self.req.true_tokens or 1) - self.gen

    @property
    def planned_left(self) -> int:
        """Planned remaining length (q90 upper bound when the predictor gives one), at least 1."""
        return max(1, self.req.planned_tokens - self.gen)


class Scheduler(Protocol):
    """Who joins and who is evicted; the engine calls these at every step boundary."""

    def add(self, req: ProfiledRequest, now: float) -> None: ...

    def has_work(self) -> bool: ...

    def admit(self, inst: SimInstance, now: float, budget: int) -> list[ProfiledRequest]: ...

    def swap_in_first(self, inst: SimInstance, now: float) -> bool: ...

    def victim(self, rows: list[SimRow], start: int, now: float) -> int: ...

    def preempted(self, req: ProfiledRequest, now: float) -> None: ...


@dataclass
class StepStats:
    """What the engine counts across all instances of a run."""

    steps: int = 0
    row_steps: int = 0            # Σ rows scheduled per step (mean batch size = row_steps / steps)
    busy_s: float = 0.0
    preemptions: int = 0
    recomputed_gen: int = 0       # generated tokens dropped and prefilled again
    dropped_kv: int = 0           # all KV tokens dropped by recompute (prompt + generated)
    decoded: int = 0              # tokens generated
    swaps: int = 0                # victims swapped out to the host pool
    recomputes: int = 0           # victims dropped for recompute
    transfer_s: float = 0.0       # step time spent moving KV over PCIe
    swap_fallbacks: int = 0       # ``swap`` victims recomputed because the host pool was full
    groups: int = 0               # admission groups taken (cohort schedulers)
    group_sizes: list[int] = field(default_factory=list)


class SimInstance:
    """One instance's page pool and running rows."""

    def __init__(self, pages: int, limits: EngineLimits, host_pages: int = 0) -> None:
        self.total_pages = pages
        self.free_pages = pages
        self.host_free = host_pages         # the swap pool's free pages (AdaptiveLLM's CPU blocks)
        self.limits = limits
        self.rows: list[SimRow] = []
        self.swapped: list[SimRow] = []     # swapped out, in the order they left (they resume here)
        self.busy_until = 0.0

    def pages_for(self, tokens: int) -> int:
        p = self.limits.page_tokens
        return -(-tokens // p)

    @property
    def capacity_tokens(self) -> int:
        return self.total_pages * self.limits.page_tokens

    def drop(self, row: SimRow) -> None:
        self.free_pages += row.pages
        row.pages = 0
        self.rows.remove(row)


Settle = Callable[[int, float, bool], None]
StepObserver = Callable[[int, int, int, float], None]


def account_step(tm: RooflineBatchTime, stats: StepStats, now: float, transfer_s: float, rows: int,
                 observer: StepObserver | None, p_tok: float, p_pairs: float, p_reads: float, d_rows: float,
                 d_reads: float) -> float:
    """Cost one step on the roofline (its prefill tokens, their attention pairs and reads, its decode
    rows and their reads) plus its PCIe transfers, count it, and return when it ends. ``observer``
    sees (decode rows, prefill tokens, context tokens attended, seconds) as a live worker's learnt
    step cost does."""
    compute = tm.step_seconds(p_tok, p_pairs, p_reads, d_rows, d_reads)
    if observer is not None:
        observer(int(d_rows), int(p_tok), int(d_reads + p_reads + p_tok), compute)
    end = now + compute + transfer_s
    stats.transfer_s += transfer_s
    stats.steps += 1
    stats.row_steps += rows
    stats.busy_s += end - now
    return end


class ContinuousEngine:
    """Runs one instance's steps; the caller (``bench.continuous_run``) owns time and arrivals."""

    def __init__(self, tm: RooflineBatchTime, scheduler: Scheduler, limits: EngineLimits, stats: StepStats,
                 settle: Settle, first_token: Callable[[int, float], None], seq: list[int],
                 preemption: PreemptionMode = "recompute", link: SwapLink | None = None,
                 dispatched: Callable[[int, float], None] | None = None,
                 step_observer: Callable[[int, int, int, float], None] | None = None) -> None:
        if preemption != "recompute" and link is None:
            raise ValueError("swap and adaptive preemption need the host link (GPU preset's PCIe bandwidth)")
        self.preemption = preemption
        self.link = link
        self.dispatched = dispatched   # a row joins (first scheduled: weighted turnaround)
        # each step's (decode rows, prefill tokens, context tokens attended, seconds), as a live
        # worker feeds its learnt step cost (``batcher.row_cost.OnlineStepCost.observe``)
        self.step_observer = step_observer
        self.transfer = 0.0   # PCIe seconds of the step being built
        self.tm = tm
        self.sched = scheduler
        self.limits = limits
        self.stats = stats
        self.settle = settle
        self.first_token = first_token
        self.seq = seq   # shared admission counter (one list cell: newest = largest)

    def _bytes_s(self, pages: int, to_host: bool) -> float:
        assert self.link is not None
        nbytes = pages * self.limits.page_tokens * self.tm.delta_bytes
        return nbytes / (self.link.to_host_bytes_per_s if to_host else self.link.to_device_bytes_per_s)

    def _recompute_s(self, inst: SimInstance, row: SimRow) -> float:
        """What re-prefilling ``row``'s KV adds to a step of the rows running beside it:
        f(rows + its tokens) − f(rows) on the step cost, cohort's true marginal,
        not a lone prefill. Zero while the step stays bound by the weight reads. Without chunked
        prefill it is the lone prefill step it will take (AdaptiveLLM's cost)."""
        k = float(row.kv)
        if not self.limits.chunked_prefill:
            return self.tm.step_seconds(k, k * k / 2.0, 0.0, 0.0, 0.0)
        others = [r for r in inst.rows if r is not row]
        d_rows = float(len(others))
        d_reads = float(sum(r.kv + 1 for r in others))
        base = self.tm.step_seconds(0.0, 0.0, 0.0, d_rows, d_reads)
        return self.tm.step_seconds(k, k * k / 2.0, 0.0, d_rows, d_reads) - base

    def _preempt(self, inst: SimInstance, row: SimRow, now: float) -> None:
        self.stats.preemptions += 1
        if self.preemption != "recompute" and row.pages and row.filled >= row.prompt:
            tokens = row.pages * self.limits.page_tokens
            assert self.link is not None
            swap_s = swap_seconds(tokens, int(self.tm.delta_bytes), self.link)
            recompute_s = self._recompute_s(inst, row)
            host_tokens = inst.host_free * self.limits.page_tokens
            if self.preemption == "swap" and tokens > host_tokens:
                self.stats.swap_fallbacks += 1   # vLLM 0.2.5 would abort here (docs/notes/benchmarks.md)
            if choose_preemption(self.preemption, swap_s, recompute_s, host_tokens, tokens) == "swap":
                self.stats.swaps += 1
                self.transfer += self._bytes_s(row.pages, True)
                inst.host_free -= row.pages
                inst.free_pages += row.pages     # the row keeps its page count: its pages are on the host
                inst.rows.remove(row)
                inst.swapped.append(row)
                return
        self.stats.recomputes += 1
        inst.drop(row)
        self.stats.recomputed_gen += row.gen
        self.stats.dropped_kv += row.kv
        # prompt_ids stay None here: the continuation's L(p) is then this run's prompt + generated
        self.sched.preempted(row.req.continuation([0] * row.gen, None), now)

    def _join(self, inst: SimInstance, req: ProfiledRequest, j: int, now: float) -> SimRow:
        if self.dispatched:
            self.dispatched(j, now)
        self.seq[0] += 1
        row = SimRow(j, req, self.seq[0])
        inst.rows.append(row)
        return row

    def _swap_in(self, inst: SimInstance, sched: list[tuple[SimRow, int]]) -> int:
        """Bring swapped rows back, oldest out first, while their pages fit; they decode this step."""
        n = 0
        while inst.swapped and len(inst.rows) < self.limits.max_num_seqs:
            r = inst.swapped[0]
            need = inst.pages_for(r.kv + 1)
            if need > inst.free_pages - self.limits.watermark_pages:
                break
            inst.swapped.pop(0)
            inst.host_free += r.pages
            self.transfer += self._bytes_s(r.pages, False)
            inst.free_pages -= need
            r.pages = need
            inst.rows.append(r)
            sched.append((r, 1))
            n += 1
        return n

    def step(self, inst: SimInstance, now: float, index: dict[str, int]) -> float | None:
        """Run one step starting at ``now``; returns its end, or None when there is nothing to run."""
        lim = self.limits
        budget = lim.max_batched_tokens
        sched: list[tuple[SimRow, int]] = []
        preempted = False
        rows = inst.rows
        if not lim.chunked_prefill and not (inst.swapped and self.sched.swap_in_first(inst, now)):
            self._admit(inst, now, index, sched, budget)
            if sched:                                         # a prefill-only step (vLLM 0.2.5)
                return self._run(inst, now, sched)
        i = 0
        while i < len(rows):
            r = rows[i]
            n = 1 if r.filled >= r.prompt else min(r.prompt - r.filled, budget)
            if n <= 0:
                i += 1
                continue
            need = inst.pages_for(r.kv + n) - r.pages
            gone = False
            while need > inst.free_pages:
                if len(rows) == 1 or inst.pages_for(r.kv + n) > inst.total_pages:
                    inst.drop(r)                              # cannot take a step even alone
                    self.settle(r.j, now, False)
                    gone = True
                    break
                v = self.sched.victim(rows, i, now)
                victim = rows[v]
                self._preempt(inst, victim, now)
                preempted = True
                if victim is r:
                    gone = True
                    break
            if gone:
                continue
            inst.free_pages -= need
            r.pages += need
            sched.append((r, n))
            budget -= n
            i += 1
        if not preempted and inst.swapped and self.sched.swap_in_first(inst, now):
            budget -= self._swap_in(inst, sched)
        elif not preempted and lim.chunked_prefill:
            self._admit(inst, now, index, sched, budget)
        if not sched and inst.swapped:     # nothing else runs: the swapped rows come back (never idle with them)
            self._swap_in(inst, sched)
        if not sched:
            return None
        return self._run(inst, now, sched)

    def _admit(self, inst: SimInstance, now: float, index: dict[str, int], sched: list[tuple[SimRow, int]],
               budget: int) -> None:
        """Waiting requests join (the scheduler's choice) and prefill their first chunk in this step."""
        if budget > 0 and len(inst.rows) < self.limits.max_num_seqs:
            for req in self.sched.admit(inst, now, budget):
                r = self._join(inst, req, index[req.id], now)
                n = min(r.prompt, budget) if self.limits.chunked_prefill else r.prompt
                need = inst.pages_for(n)
                if n <= 0 or need > inst.free_pages:
                    continue                                  # joins; prefills from the next step
                inst.free_pages -= need
                r.pages = need
                sched.append((r, n))
                budget -= n

    def _run(self, inst: SimInstance, now: float, sched: list[tuple[SimRow, int]]) -> float:
        """Cost the step on the roofline (plus its PCIe transfers) and advance its rows."""
        p_tok = p_pairs = p_reads = d_rows = d_reads = 0.0
        for r, n in sched:
            if r.filled < r.prompt:
                p_tok += n
                p_pairs += n * (r.kv + n / 2.0)
                p_reads += r.kv
            else:
                d_rows += 1
                d_reads += r.kv + 1
        if not self.limits.chunked_prefill and not d_rows:   # vLLM 0.2.5 pads every prompt to the longest
            width = float(max(n for _, n in sched))
            p_tok, p_pairs = width * len(sched), len(sched) * width * width / 2.0
        end = account_step(self.tm, self.stats, now, self.transfer, len(sched), self.step_observer,
                           p_tok, p_pairs, p_reads, d_rows, d_reads)
        self.transfer = 0.0
        st = self.stats
        for r, n in sched:
            r.kv += n
            if r.filled < r.prompt:
                r.filled += n
                if r.filled < r.prompt:
                    continue
                self.first_token(r.j, end)
            r.gen += 1
            st.decoded += 1
            if r.gen >= (r.req.true_tokens or 1):
                inst.drop(r)
                self.settle(r.j, end, True)
        inst.busy_until = end
        return end

