"""Who joins a continuous engine's running set and who leaves it when pages run out.

* ``FCFSScheduler`` is ``cb-fcfs``, vLLM's default scheduler as the simulator models it: one FCFS
  queue of requests; at a step boundary the oldest waiting requests join while the step's token
  budget, ``max_num_seqs`` and free pages allow (a prompt's first chunk must find its pages);
  when a running row needs a page and none is free, the *newest* running row is preempted by
  recompute and goes back to the front of the queue.
* cohort's policies do not run here: they run the live worker's running set
  (``bench.group_engine``, ``batcher.running_set``), so the simulator admits and evicts as the
  worker does.
"""

from __future__ import annotations

from collections import deque

from bench.continuous import EngineLimits, SimInstance, SimRow
from cohort.types import ProfiledRequest


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
