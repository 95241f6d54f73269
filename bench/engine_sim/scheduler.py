"""One step's choice, as vLLM v1's scheduler makes it: which requests run and how many tokens each.

The rules kept (they decide the latencies a front sees):

* Running requests first, in the running list's order, each getting ``num_tokens −
  num_computed_tokens`` tokens (one for a decode, a chunk for a prefill) out of
  ``max_num_batched_tokens``, never past ``max_model_len − 1`` positions. A prompt longer than
  what is left of the budget is chunked: chunked prefill is always on.
* When a running request cannot get the blocks its tokens need, the scheduler preempts (by
  recompute: its blocks are freed, its computed count goes to 0, it goes to the *front* of the
  waiting queue) the last request of the running list (FCFS), or the one with the largest
  (priority, arrival), i.e. the lowest priority and latest (priority) — until it fits or the
  victim is the request itself.
* Waiting requests are taken only in a step that preempted nobody, while the budget lasts and
  fewer than ``max_num_seqs`` run, in the waiting queue's order (arrival; or priority, lower value
  first, then arrival); a new one first reuses its cached prefix. The first that cannot get its
  blocks stops the admission (head-of-line, as in vLLM).
* After the step, a request whose computed tokens reached its length samples one token; it
  finishes at ``max_tokens`` output tokens or at ``max_model_len`` tokens, with reason "length".

Left out: speculative decoding, encoder inputs, LoRA, KV connectors, async scheduling,
``long_prefill_token_threshold`` and the structured-output wait.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from bench.engine_sim.kv_blocks import KVCacheManager
from bench.engine_sim.request import SimRequest, Status

FCFS, PRIORITY = "fcfs", "priority"


class FCFSQueue:
    """Arrival order; a preempted request goes back to the front."""

    def __init__(self) -> None:
        self._q: deque[SimRequest] = deque()

    def add(self, r: SimRequest) -> None:
        self._q.append(r)

    def prepend(self, r: SimRequest) -> None:
        self._q.appendleft(r)

    def peek(self) -> SimRequest:
        return self._q[0]

    def pop(self) -> SimRequest:
        return self._q.popleft()

    def remove(self, r: SimRequest) -> None:
        self._q.remove(r)

    def __len__(self) -> int:
        return len(self._q)

    def __iter__(self) -> Iterator[SimRequest]:
        return iter(self._q)


class PriorityQueue:
    """A heap on (priority, arrival): a preempted request goes back in by the same key, which puts
    it ahead of everything that arrived after it at its priority."""

    def __init__(self) -> None:
        self._h: list[tuple[int, float, int, SimRequest]] = []
        self._seq = itertools.count()

    def add(self, r: SimRequest) -> None:
        heapq.heappush(self._h, (r.priority, r.arrival, next(self._seq), r))

    prepend = add

    def peek(self) -> SimRequest:
        return self._h[0][3]

    def pop(self) -> SimRequest:
        return heapq.heappop(self._h)[3]

    def remove(self, r: SimRequest) -> None:
        self._h = [e for e in self._h if e[3] is not r]
        heapq.heapify(self._h)

    def __len__(self) -> int:
        return len(self._h)

    def __iter__(self) -> Iterator[SimRequest]:
        return (e[3] for e in sorted(self._h))


@dataclass
class ScheduledRow:
    """One request's share of a step: ``num_new`` tokens after ``num_computed`` already in KV."""

    req: SimRequest
    num_new: int
    num_computed: int

    @property
    def is_decode(self) -> bool:
        """One token, the last one, of a request that has output: a decode row (everything else,
        resumed recomputes included, is prefill work)."""
        return self.num_new == 1 and self.req.num_output_tokens > 0 and \
            self.num_computed + 1 == self.req.num_tokens


@dataclass
class SimStep:
    rows: list[ScheduledRow] = field(default_factory=list)
    preempted: list[SimRequest] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(r.num_new for r in self.rows)


@dataclass
class TokenOut:
    """A token a step produced for a request, and the finish reason when it was the last."""

    req: SimRequest
    token_id: int
    finish: str | None


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 max_model_len: int = 8192, policy: str = FCFS) -> None:
        if policy not in (FCFS, PRIORITY):
            raise ValueError(f"scheduling policy must be {FCFS} or {PRIORITY}, got {policy!r}")
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting: FCFSQueue | PriorityQueue = PriorityQueue() if policy == PRIORITY else FCFSQueue()
        self.running: list[SimRequest] = []
        self.num_preemptions = 0

    def add_request(self, req: SimRequest) -> None:
        req.status = Status.WAITING
        self.waiting.add(req)

    def has_work(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def abort(self, req: SimRequest) -> None:
        """Drop a request wherever it is, freeing its blocks (a client that went away)."""
        if req.status in (Status.WAITING, Status.PREEMPTED):
            self.waiting.remove(req)
        elif req.status == Status.RUNNING:
            self.running.remove(req)
            self.kv.free(req)
        else:
            return
        req.status = Status.ABORTED

    def _victim(self) -> SimRequest:
        if self.policy == PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival))
        return self.running[-1]

    def _preempt(self, req: SimRequest) -> None:
        self.kv.free(req)
        req.status = Status.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(req)

    def schedule(self) -> SimStep:
        """Choose this step's rows and advance their computed counts (see the module docstring)."""
        plan = SimStep()
        scheduled: dict[int, ScheduledRow] = {}   # id(req) → its row, for the running pass
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget,
                    self.max_model_len - 1 - req.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            while True:
                if self.kv.allocate_slots(req, n) is not None:
                    break
                victim = self._victim()
                at = self.running.index(victim)
                self.running.pop(at)
                row = scheduled.pop(id(victim), None)
                if row is not None:
                    budget += row.num_new
                    plan.rows.remove(row)
                if at < i:
                    i -= 1
                self._preempt(victim)
                plan.preempted.append(victim)
                if victim is req:
                    break
            if req.status != Status.RUNNING:
                break
            row = ScheduledRow(req, n, req.num_computed_tokens)
            plan.rows.append(row)
            scheduled[id(req)] = row
            budget -= n
            i += 1
        if not plan.preempted:
            budget = self._admit(plan, budget)
        for row in plan.rows:
            row.req.num_computed_tokens += row.num_new
        return plan

    def _admit(self, plan: SimStep, budget: int) -> int:
        while len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.peek()
            cached, hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - hit, budget)
            if self.kv.allocate_slots(req, n, hit, cached) is None:
                break
            self.waiting.pop()
            self.kv.record_lookup(req, hit)
            req.status = Status.RUNNING
            req.num_computed_tokens = hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = hit
            self.running.append(req)
            plan.rows.append(ScheduledRow(req, n, hit))
            budget -= n
        return budget

    def update(self, plan: SimStep) -> list[TokenOut]:
        """After the step ran: every scheduled request whose computed tokens caught up with its
        length samples a token; those at their limit finish and free their blocks. Rows aborted
        while the step ran are skipped."""
        out: list[TokenOut] = []
        finished: list[SimRequest] = []
        for row in plan.rows:
            req = row.req
            if req.status != Status.RUNNING or req.num_computed_tokens < req.num_tokens:
                continue
            tid = req.draw()
            req.output_ids.append(tid)
            finish = None
            if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
                finish = req.finish_reason = "length"
                finished.append(req)
            out.append(TokenOut(req, tid, finish))
        if finished:
            gone = set(map(id, finished))
            self.running = [r for r in self.running if id(r) not in gone]
            for req in finished:
                req.status = Status.FINISHED
                self.kv.free(req)
        return out
