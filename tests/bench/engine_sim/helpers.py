"""Hand-built requests and a scheduler for the engine simulator's CPU-only tests (the way vLLM
v1's own scheduler tests build them: token ids by hand, no server, no clock)."""

from __future__ import annotations

import itertools

from bench.engine_sim.kv_blocks import KVCacheManager
from bench.engine_sim.request import SimRequest
from bench.engine_sim.scheduler import FCFS, Scheduler

_ids = itertools.count(1)


def make_req(prompt: list[int] | int, max_tokens: int = 8, priority: int = 0, arrival: float | None = None,
             name: str | None = None) -> SimRequest:
    """A request whose prompt is ``prompt`` (a length: distinct ids from 1000 on) and whose output
    ids count up from 50000."""
    n = next(_ids)
    ids = list(range(1000 * n, 1000 * n + prompt)) if isinstance(prompt, int) else list(prompt)
    out = itertools.count(50000)
    return SimRequest(name or f"r{n}", ids, max_tokens, lambda: next(out), priority=priority,
                      arrival=float(n) if arrival is None else arrival)


def make_sched(num_blocks: int = 100, block_size: int = 16, max_num_seqs: int = 16, budget: int = 8192,
               max_model_len: int = 1024, policy: str = FCFS, caching: bool = True) -> Scheduler:
    kv = KVCacheManager(num_blocks, block_size, max_model_len, caching)
    return Scheduler(kv, max_num_seqs, budget, max_model_len, policy)


def step(s: Scheduler) -> dict[str, int]:
    """One step: schedule, then update; the tokens each request got, by name."""
    plan = s.schedule()
    s.update(plan)
    return {r.req.request_id: r.num_new for r in plan.rows}
