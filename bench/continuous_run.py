"""A trace through N continuous-engine instances: arrivals, step boundaries, metrics.

Time advances from event to event: the next arrival or the next instance's step boundary
(instances step independently, each at its own pace). An instance with nothing to run sleeps
until an arrival or a preemption gives the scheduler work. ``cb-fcfs`` shares one FCFS queue
between the instances (a perfect load balancer: the baseline at its best); cohort's policies
hand each instance its own next admission group.

``physical_bound`` is the request rate no scheduler can beat on this roofline: the trace's work
(every prompt and generated token through the weights once, every generated token reading its own
context once, the fewest steps that Θ and ``max_num_seqs`` allow, each paying the step overhead
and one weight read) spread over the instances, and never faster than the requests arrive.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from batcher.memory import KVMemory
from batcher.policies import PolicyContext, make_policy, planning_memory
from batcher.preemption import SwapLink
from batcher.row_cost import DecodeStepCost
from bench.continuous import ContinuousEngine, EngineLimits, Scheduler, SimInstance, StepStats
from bench.continuous_sched import AdaptiveFairScheduler, FCFSScheduler
from bench.group_engine import GroupEngine, GroupScheduler
from bench.metrics import SimResult, TraceBook
from bench.online_quantile import OnlineQuantile, OnlineScheduler
from bench.roofline import RooflineBatchTime
from cohort.continuous_knobs import ContinuousSettings
from cohort.settings import PreemptionMode
from cohort.types import ProfiledRequest

CB_FCFS = "cb-fcfs"
ADAPTIVE_FAIR = "adaptive-fair"   # AdaptiveLLM's Algorithm 2 (FCFS engine rules, fairness order)
ENGINE_SCHEDULERS = (CB_FCFS, ADAPTIVE_FAIR)   # request-level schedulers: continuous execution only
# Share of Θ a cohort policy plans one admission group with under ``continuous``: the live
# batcher's default (COHORT_CONTINUOUS__GROUP_FRAC), so the simulator and the stack plan alike.
DEFAULT_GROUP_FRAC = ContinuousSettings.model_fields["group_frac"].default
# Most rows a cohort policy's instance runs at once (COHORT_CONTINUOUS__MAX_ROWS): cohort's own cap,
# where cb-fcfs and adaptive-fair keep vLLM's max_num_seqs (``EngineLimits``).
DEFAULT_MAX_ROWS = ContinuousSettings.model_fields["max_rows"].default
# A row joins a cohort policy's instance while its marginal step cost is at most this share of the
# running rows' mean (COHORT_CONTINUOUS__MARGINAL_COST, ``batcher.row_cost``); cb-fcfs has no such rule.
DEFAULT_MARGINAL_COST = ContinuousSettings.model_fields["marginal_cost"].default


def engine_limits(policy: str, limits: EngineLimits, max_rows: int) -> EngineLimits:
    """The limits ``policy``'s instances run under: vLLM's for the request-level schedulers, the
    same with cohort's row cap for a cohort policy."""
    if policy in ENGINE_SCHEDULERS:
        return limits
    return replace(limits, max_num_seqs=min(limits.max_num_seqs, max_rows))


def make_scheduler(policy: str, memory: KVMemory, time_model: RooflineBatchTime, limits: EngineLimits,
                   params: dict[str, Any], max_input_tokens: int, max_tokens_limit: int, headroom: float,
                   group_frac: float, max_preemptions: int, marginal_cost: float = DEFAULT_MARGINAL_COST,
                   step_cost: DecodeStepCost | None = None, prefix_caching: bool = False,
                   prefix_affinity: int = 0) -> Scheduler | GroupScheduler:
    """``cb-fcfs`` or a cohort policy (by base name) planning groups with Θ·group_frac, its rows
    joining while they pay for themselves (``marginal_cost``) on ``step_cost``: the roofline's
    step by default, or a cost learnt from the simulated steps as a live worker learns its own."""
    if policy == CB_FCFS:
        return FCFSScheduler(limits)
    if policy == ADAPTIVE_FAIR:
        return AdaptiveFairScheduler(limits)
    plan_mem = planning_memory(policy, memory, headroom, group_frac)
    ctx = PolicyContext(memory=plan_mem, estimator=time_model, max_input_tokens=max_input_tokens,
                        max_tokens_limit=max_tokens_limit, elastic=True,
                        prefix_page_tokens=limits.page_tokens if prefix_caching else 0)
    return GroupScheduler(make_policy(policy, ctx, **params), limits, max_preemptions,
                          time_model if step_cost is None else step_cost, marginal_cost, prefix_caching, prefix_affinity)


def simulate_continuous(requests: Sequence[ProfiledRequest], policy: str, scheduler: Scheduler | GroupScheduler,
                        memory: KVMemory,
                        time_model: RooflineBatchTime, instances: int, limits: EngineLimits,
                        progress: Callable[[int], None] | None = None, preemption: PreemptionMode = "recompute",
                        link: SwapLink | None = None, host_pages: int = 0,
                        online: OnlineQuantile | None = None, bound_limits: EngineLimits | None = None,
                        step_observer: Callable[[int, int, int, float], None] | None = None) -> SimResult:
    """Run the trace (sorted by arrival, ``true_tokens`` set) on ``instances`` continuous engines,
    each with ``host_pages`` of swap pool behind ``link`` (``preemption``: ``bench.continuous``).
    ``online``: arrivals are planned with the online quantile, fed by the completions
    (``bench.online_quantile``); None plans with the trace's own bounds. ``bound_limits``: the
    engine's limits for the physical bound when ``limits`` carry a cohort policy's own row cap
    (a scheduling choice, not the hardware's: every policy of a run is measured against one bound).
    ``step_observer`` sees every step as a live worker's learnt step cost does."""
    if not hasattr(time_model, "step_seconds"):
        raise ValueError("continuous execution needs the roofline time model (a step cost), not a fitted one")
    t0 = time.perf_counter()
    book = TraceBook(requests, progress)
    arrival, order = book.arrival, book.order
    n = len(requests)
    pages = memory.theta_tokens // limits.page_tokens
    insts = [SimInstance(pages, limits, host_pages) for _ in range(instances)]
    stats = StepStats()
    settle = book.settle
    groups = scheduler if isinstance(scheduler, GroupScheduler) else None
    if online is not None:
        scheduler = OnlineScheduler(scheduler, online)

        def settle(j: int, at: float, done: bool) -> None:
            book.settle(j, at, done)
            if done:
                online.completed(requests[j])

    engine: ContinuousEngine | GroupEngine = ContinuousEngine(
        time_model, scheduler, limits, stats, settle, book.first_token, [0], preemption, link, book.dispatched,
        step_observer) if groups is None else GroupEngine(time_model, groups, limits, stats, settle, book.first_token,
                                                          preemption, link, book.dispatched, step_observer)
    heap: list[tuple[float, int]] = []
    idle = set(range(instances))
    i, now = 0, 0.0

    def wake(at: float) -> None:
        for k in sorted(idle):
            heapq.heappush(heap, (at, k))
        idle.clear()

    while i < n or heap:
        t_arr = float(arrival[order[i]]) if i < n else math.inf
        if heap and heap[0][0] <= t_arr:
            now, k = heapq.heappop(heap)
            inst = insts[k]
            end = engine.step(inst, now, book.index)
            if groups is not None and groups.declined:   # groups left to instances holding their prefix:
                for j in sorted(idle):                   # a sleeping one among them pulls them now
                    if id(insts[j]) in groups.declined:
                        idle.discard(j)
                        heapq.heappush(heap, (now, j))
                groups.declined.clear()
            if end is None:
                idle.add(k)
            else:
                heapq.heappush(heap, (end, k))
                if idle and scheduler.has_work():
                    wake(end)
        else:
            now = t_arr
            scheduler.add(requests[order[i]], now)
            i += 1
            if idle:
                wake(now)
    book.fail_unsettled(now)
    metrics = book.metrics([], stats.decoded, 0.0, 0, preemptions=stats.preemptions, decoded_tokens=stats.decoded,
                           recomputed_tokens=stats.recomputed_gen)
    metrics["swaps"], metrics["recomputes"] = stats.swaps, stats.recomputes
    metrics["mean_batch_size"] = stats.row_steps / stats.steps if stats.steps else 0.0
    bound = physical_bound(requests, time_model, memory, instances, bound_limits or limits)
    extra = {"execution": "continuous", "policy": policy, "steps": stats.steps,
             "busy_frac": stats.busy_s / (instances * now) if now else 0.0, "dropped_kv_tokens": stats.dropped_kv,
             "preemption": preemption, "swaps": stats.swaps, "recomputes": stats.recomputes,
             "transfer_s": stats.transfer_s, "host_pages": host_pages,
             "swap_fallbacks": stats.swap_fallbacks, "quantile": "static" if online is None else "online",
             "physical_bound_rps": bound, "limits": {"page_tokens": limits.page_tokens,
                                                     "max_batched_tokens": limits.max_batched_tokens,
                                                     "max_num_seqs": limits.max_num_seqs}}
    metrics["physical_bound_rps"] = bound
    if isinstance(engine, GroupEngine):
        metrics.update(engine.prefix_stats())
    return SimResult(policy, metrics, time.perf_counter() - t0, stats.steps, now, extra)


def physical_bound(requests: Sequence[ProfiledRequest], tm: RooflineBatchTime, memory: KVMemory, instances: int,
                   limits: EngineLimits) -> float:
    """Requests/s no schedule can beat (module docstring): N ÷ max(arrival span, work ÷ instances)."""
    L = np.array([r.input_tokens for r in requests], dtype=float)
    G = np.array([r.true_tokens for r in requests], dtype=float)
    if not len(L):
        return 0.0
    kv_steps = float(np.sum(G * L + G * (G - 1) / 2.0))         # Σ_i Σ_{g<G_i} (L_i + g): context read per token
    steps = max(kv_steps / max(1, memory.theta_tokens), float(G.sum()) / limits.max_num_seqs)
    flops = float(np.sum(2.0 * tm.params * (L + G) + 2.0 * tm.layers * tm.hidden * L * L))
    reads = steps * tm.weight_bytes + kv_steps * tm.delta_bytes
    work = max(flops / (tm.flops * tm.compute_eff), reads / (tm.bandwidth * tm.bandwidth_eff)) \
        + steps * tm.step_overhead_s
    arr = np.array([r.arrival for r in requests], dtype=float)
    span = max(float(arr.max() - arr.min()), work / instances)
    return len(requests) / span if span > 0 else math.inf
