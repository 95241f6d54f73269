"""Who joins a continuous engine's running set and who leaves it when pages run out.

* ``FCFSScheduler`` is ``cb-fcfs``, vLLM's default scheduler as the simulator models it: one FCFS
  queue of requests; at a step boundary the oldest waiting requests join while the step's token
  budget, ``max_num_seqs`` and free pages allow (a prompt's first chunk must find its pages);
  when a running row needs a page and none is free, the *newest* running row is preempted by
  recompute and goes back to the front of the queue.
* ``GroupScheduler`` is cohort under ``continuous``: the batching policy (WMA/Magnus, S3, SLO-ODBS,
  HRRN, VS…) still forms and orders batches, each planned with the policy's own KV rule under an
  admission budget (a share of Θ); a batch is an *admission group* the instance takes at a step
  boundary as soon as the KV peak of its rows plus the running rows, on planned lengths (q90 when
  the predictor gives one), fits Θ, the rows stay within ``max_num_seqs`` and the last one still
  pays for itself on the roofline's step (``batcher.elastic.running_set_fits``,
  ``COHORT_CONTINUOUS_MARGINAL_COST``). Rows that run out of pages
  anyway (under-predicted) are evicted largest predicted remaining first
  (``batcher.elastic.eviction_order``) and re-enter the policy as continuations.
"""

from __future__ import annotations

from collections import deque

from batcher.elastic import eviction_order
from batcher.kv_judge import KVJudge
from batcher.policies.base import Policy
from batcher.row_cost import DecodeStepCost
from bench.continuous import EngineLimits, SimInstance, SimRow
from cohort.types import Batch, ProfiledRequest


class FCFSScheduler:
    """cb-fcfs: FCFS admission while pages are free, preempt the newest by recompute."""

    def __init__(self, limits: EngineLimits) -> None:
        self.limits = limits
        self.waiting: deque[ProfiledRequest] = deque()

    def add(self, req: ProfiledRequest, now: float) -> None:
        self.waiting.append(req)

    def preempted(self, req: ProfiledRequest, now: float) -> None:
        self.waiting.appendleft(req)

    def has_work(self) -> bool:
        return bool(self.waiting)

    def admit(self, inst: SimInstance, now: float, budget: int) -> list[ProfiledRequest]:
        if not self.limits.chunked_prefill:
            return self._admit_whole(inst)
        out: list[ProfiledRequest] = []
        free, n_rows = inst.free_pages, len(inst.rows)
        while self.waiting and n_rows < self.limits.max_num_seqs and budget > 0:
            n = min(self.waiting[0].input_tokens, budget)
            need = inst.pages_for(n)
            if need > free and (n_rows or out):   # an empty instance takes it (and fails it if it never fits)
                break
            out.append(self.waiting.popleft())
            free -= need
            budget -= n
            n_rows += 1
        return out

    def _admit_whole(self, inst: SimInstance) -> list[ProfiledRequest]:
        """vLLM 0.2.5's prompt step: whole prompts in queue order while their pages fit above the
        watermark, the padded batch β·max L fits ``max_batched_tokens`` and pads ≤ ``max_paddings``."""
        lim = self.limits
        out: list[ProfiledRequest] = []
        free, n_rows, lens = inst.free_pages, len(inst.rows), []
        while self.waiting and n_rows < lim.max_num_seqs:
            n = self.waiting[0].input_tokens
            need = inst.pages_for(n)
            width = max([n, *lens])
            if lens and (width * (len(lens) + 1) > lim.max_batched_tokens
                         or width * (len(lens) + 1) - sum(lens) - n > lim.max_paddings):
                break
            if free - need < lim.watermark_pages and (n_rows or out):
                break
            out.append(self.waiting.popleft())
            lens.append(n)
            free -= need
            n_rows += 1
        return out

    def victim(self, rows: list[SimRow], start: int, now: float) -> int:
        """vLLM's FCFS victim: the running row that arrived last (its running list is kept in arrival order)."""
        return max(range(start, len(rows)), key=lambda i: (rows[i].req.arrival, rows[i].order))

    def swap_in_first(self, inst: SimInstance, now: float) -> bool:
        """vLLM: while any row is swapped out, bring those back and admit no new prompt."""
        return True


def fair_priority(first_wait: float, tokens: int, now: float) -> float:
    """AdaptiveLLM's P (§3.5): time since first entering the waiting queue ÷ (prompt + generated tokens)."""
    return max(0.0, now - first_wait) / max(1, tokens)


class AdaptiveFairScheduler(FCFSScheduler):
    """``adaptive-fair`` (AdaptiveLLM Algorithm 2): at each step boundary either the swapped set
    comes back or waiting requests are prefilled, whichever candidate set has the higher mean P;
    waiting requests join highest P first; the victim is the running row with the lowest P."""

    def _sorted(self, now: float) -> None:
        self.waiting = deque(sorted(self.waiting, key=lambda q: -fair_priority(q.arrival, q.input_tokens, now)))

    def admit(self, inst: SimInstance, now: float, budget: int) -> list[ProfiledRequest]:
        self._sorted(now)
        return super().admit(inst, now, budget)

    def swap_in_first(self, inst: SimInstance, now: float) -> bool:
        if not self.waiting:
            return True
        free, k, swapped = inst.free_pages, 0, []
        for r in inst.swapped:                     # the rows that could come back now (line 6)
            need = inst.pages_for(r.kv + 1)
            if need > free:
                break
            free -= need
            swapped.append(fair_priority(r.req.arrival, r.kv, now))
        self._sorted(now)
        joining, free = [], inst.free_pages
        for q in self.waiting:                    # the requests that could be prefilled now (line 7)
            need = inst.pages_for(q.input_tokens)
            if need > free or k >= self.limits.max_num_seqs:
                break
            free -= need
            k += 1
            joining.append(fair_priority(q.arrival, q.input_tokens, now))
        if not swapped:
            return not joining and not inst.rows
        return not joining or sum(swapped) / len(swapped) >= sum(joining) / len(joining)

    def victim(self, rows: list[SimRow], start: int, now: float) -> int:
        cand = range(start, len(rows))
        return min(cand, key=lambda i: (fair_priority(rows[i].req.arrival, rows[i].kv, now), -rows[i].order))


class GroupScheduler:
    """cohort's policy under continuous execution: batches are admission groups (module docstring)."""

    def __init__(self, policy: Policy, limits: EngineLimits, max_preemptions: int = 8,
                 step_cost: DecodeStepCost | None = None, marginal_cost: float = 0.0) -> None:
        self.pol = policy
        self.limits = limits
        self.max_preemptions = max_preemptions
        self.step_cost, self.marginal_cost = step_cost, marginal_cost  # batcher.row_cost
        self.pending: dict[int, Batch] = {}   # instance id -> the group it took and waits to fit
        self.queued = 0                      # requests in the policy, not yet in a group

    def add(self, req: ProfiledRequest, now: float) -> None:
        self.pol.add(req, now)
        self.queued += 1

    def preempted(self, req: ProfiledRequest, now: float) -> None:
        self.add(req, now)

    def has_work(self) -> bool:
        return self.queued > 0

    def _fits(self, inst: SimInstance, joining: list[ProfiledRequest], group: Batch) -> bool:
        rows = inst.rows
        if not rows and not joining:
            return True                       # an empty instance takes any group (too large: its rows fail)
        ctx = [r.kv + r.prompt - r.filled for r in rows]
        left = [r.planned_left for r in rows]
        for q in (*joining, *group.requests):
            ctx.append(q.input_tokens)
            left.append(max(1, q.planned_tokens))
        judge = KVJudge(inst.capacity_tokens, self.limits.page_tokens, self.limits.max_num_seqs, self.marginal_cost)
        return judge.running_set_fits(ctx, left, self.step_cost)

    def admit(self, inst: SimInstance, now: float, budget: int) -> list[ProfiledRequest]:
        out: list[ProfiledRequest] = []
        key = id(inst)
        while True:
            group = self.pending.pop(key, None)
            if group is None:
                if not self.queued:
                    break
                group = self.pol.pop(now)
                if group is None:
                    break
                self.queued -= group.size
            if not self._fits(inst, out, group):
                self.pending[key] = group
                break
            out.extend(group.requests)
        return out

    def swap_in_first(self, inst: SimInstance, now: float) -> bool:
        return True

    def victim(self, rows: list[SimRow], start: int, now: float) -> int:
        cand = rows[start:]
        order = eviction_order([r.planned_left for r in cand], [r.req.preemptions for r in cand],
                               self.max_preemptions)
        return start + order[0]
