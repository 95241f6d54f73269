"""Discrete-event simulation of N LLM instances fed by one batching policy.

Events are arrivals (the workload's Poisson trace), batch ends and preempted rows coming back.
After every event, while an instance is idle and the policy has work, ``policy.pop(now)``
chooses a batch — exactly the live batcher's contract (nothing is handed out before an instance
is free).

How a batch runs is ``bench.execution.simulate_batch_run`` with the requests' *true* lengths:

* ``execution="static"`` (the papers): the batch decodes until its longest member ends, for
  ``time_model.estimate(β, L(B), G(B))``; every member is answered then.
* ``execution="elastic"``: each row is answered when its own tokens are done and leaves; the
  batch's time sums the model's decode steps with the alive β (formula in ``bench.execution``).

When the true KV would pass Θ at a step:

* ``oom_recovery="split"`` (Magnus): the instance is busy until that step, then the rows still
  running are split in halves (``batcher.oom.split_batch``) and both restart from zero; a batch
  of one that cannot fit fails its request.
* ``oom_recovery="preempt"``: rows are evicted (``batcher.elastic.eviction_order``) before the
  step and re-enter the policy as continuations (``ProfiledRequest.continuation``: the tokens
  done are kept, L(p) grows by them, the remaining lengths shrink); a row that cannot take a
  step even alone fails.

The policies plan for the same execution (``PolicyContext.elastic``). Every request ends either
completed or failed, and ``completed + failed`` equals the requests sent. The defaults (static,
split) reproduce the earlier simulator exactly.

Pure Python/NumPy: the policies are the live batcher's own classes.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from batcher.memory import KVMemory
from batcher.oom import UnsplittableBatch, split_batch
from batcher.policies import PolicyContext, make_policy, planning_memory
from batcher.policies.base import BatchTimeModel
from batcher.preemption import SwapLink
from batcher.row_cost import OnlineStepCost
from batcher.wma import total_wma, wma_gen
from bench.continuous import EngineLimits
from bench.continuous_run import (
    DEFAULT_GROUP_FRAC,
    DEFAULT_MARGINAL_COST,
    DEFAULT_MAX_ROWS,
    ENGINE_SCHEDULERS,
    engine_limits,
    make_scheduler,
    simulate_continuous,
)
from bench.execution import EXECUTIONS, RECOVERIES, SimBatchRun, simulate_batch_run
from bench.metrics import SimResult, TraceBook
from bench.online_quantile import OnlineQuantile
from cohort.settings import PreemptionMode, Settings
from cohort.types import Batch, ProfiledRequest

# Φ when a run does not set one: the live batcher's default (``COHORT_WMA_THRESHOLD``), so a
# simulated policy and a served one assemble the same batches.
DEFAULT_THRESHOLD: float = Settings.model_fields["wma_threshold"].default

def parse_policy(name: str) -> tuple[str, bool]:
    """``magnus+oracle`` → ("magnus", True): the policy sees true lengths as predictions. An
    execution suffix (``@elastic``, see ``parse_run``) is ignored here."""
    base, _, suffix = name.partition("@")[0].partition("+")
    if suffix and suffix != "oracle":
        raise ValueError(f"{name!r}: the only suffix is +oracle")
    return base, bool(suffix)


DEFAULT_RECOVERY = {"static": "split", "elastic": "preempt", "continuous": "preempt"}
# static and elastic run whole batches (bench.execution); continuous runs steps (bench.continuous)
SIM_EXECUTIONS = (*EXECUTIONS, "continuous")


def parse_run(name: str, executions: Sequence[str] = ("static",), recovery: str | None = None
              ) -> list[tuple[str, str, str]]:
    """The runs a policy name asks for: [(result key, execution, OOM recovery)].

    ``NAME[+oracle][@EXECUTION[/RECOVERY]]``; without ``@`` the name runs once per entry of
    ``executions``. A run's recovery is its ``/RECOVERY``, else ``recovery``, else the mode's own:
    ``split`` for ``static`` (the papers: Magnus's split-and-restart), ``preempt`` for ``elastic``
    (the product). Keys are ``NAME[+oracle]@EXECUTION``, plus ``/RECOVERY`` when it is not the
    mode's own, e.g. ``magnus+oracle@static``, ``magnus@elastic``, ``magnus@elastic/split``.
    """
    parse_policy(name)
    head, _, spec = name.partition("@")
    if head in ENGINE_SCHEDULERS:   # vLLM's default scheduler, AdaptiveLLM's: continuous execution only
        if spec not in ("", "continuous"):
            raise ValueError(f"{name!r}: {head} runs only under continuous execution")
        return [(head, "continuous", "preempt")]
    out = []
    for ex_spec in ([spec] if spec else list(executions)):
        ex, _, rec = ex_spec.partition("/")
        rec = rec or recovery or DEFAULT_RECOVERY.get(ex, "")
        if ex not in SIM_EXECUTIONS or rec not in RECOVERIES or (ex == "continuous" and rec != "preempt"):
            raise ValueError(f"{name!r}: execution must be one of {SIM_EXECUTIONS}, recovery one of "
                             f"{RECOVERIES} (continuous: preempt)")
        key = f"{head}@{ex}" + (f"/{rec}" if rec != DEFAULT_RECOVERY[ex] else "")
        out.append((key, ex, rec))
    return out


def continuation(req: ProfiledRequest, kept: int, now: float | None) -> ProfiledRequest:
    """``req`` preempted after ``kept`` tokens of this run, as the worker hands it back. The
    simulator has no token ids: the prompt and generated tokens are stand-in zeros (only their
    counts matter to planning: L(p) grows by ``kept``, the remaining lengths shrink by it). The
    stand-in prompt has L(p) zeros: an empty one would resume from the generated tokens alone."""
    base = req if req.prompt_ids is not None else replace(req, prompt_ids=[0] * req.input_tokens)
    return base.continuation([0] * kept, now if kept else None)


def simulate(requests: Sequence[ProfiledRequest], policy: str, memory: KVMemory, time_model: BatchTimeModel,
             instances: int = 8, estimator: BatchTimeModel | None = None, max_input_tokens: int = 2048,
             max_tokens_limit: int = 2048, params: dict[str, Any] | None = None,
             progress: Callable[[int], None] | None = None, headroom: float = 0.0,
             execution: str = "static", oom_recovery: str = "split", max_preemptions: int = 8,
             limits: EngineLimits = EngineLimits(), group_frac: float = DEFAULT_GROUP_FRAC,
             preemption: PreemptionMode = "recompute", link: SwapLink | None = None, host_pages: int = 0,
             online: OnlineQuantile | None = None, max_rows: int = DEFAULT_MAX_ROWS,
             marginal_cost: float = DEFAULT_MARGINAL_COST, learnt_step_cost: bool = False,
             prefix_caching: bool = False, prefix_affinity: int = 0) -> SimResult:
    """Run one policy over a request trace (sorted by arrival) on ``instances`` identical instances.

    ``requests`` must carry ``true_tokens``; the policy reads ``predicted_tokens`` (build the
    list with ``Workload.requests(oracle=True)`` for ``NAME+oracle``). ``estimator`` is the
    policy's batch-time estimate (default: the time model itself). ``progress(k)`` is called
    with the number of newly finished requests (completed or failed). ``headroom`` makes the
    policy plan with Θ·(1 − headroom) while the instance still has Θ: slack for under-predicted
    lengths, so fewer batches run out of memory (0 = the policy sees the true Θ, as in SPEC;
    VS always plans with Θ). ``params`` are the policy's settings (``make_policy``); Φ defaults to
    ``DEFAULT_THRESHOLD``. ``execution`` and ``oom_recovery`` pick how batches run
    (``bench.execution``); the policies plan for the same execution (``PolicyContext.elastic``).
    The defaults are the papers' (static, split). ``execution="continuous"`` runs steps instead
    (``bench.continuous``: ``limits`` are the engine's, cohort policies plan admission groups with
    Θ·``group_frac`` and run at most ``max_rows`` rows per instance, each joining while its
    marginal step cost is at most ``marginal_cost`` × the mean per row — priced on the roofline,
    or with ``learnt_step_cost`` on a cost learnt from the simulated steps (``OnlineStepCost``, one
    for the run's identical instances) as a live worker prices it; ``cb-fcfs`` is vLLM's default
    scheduler, ``adaptive-fair`` AdaptiveLLM's) on
    the roofline time model, preempting by ``preemption`` (swap: ``host_pages`` behind ``link``),
    planning arrivals with ``online``'s current quantile when given (``bench.online_quantile``);
    cohort policies' instances keep a prefix cache with ``prefix_caching`` (requests need
    ``prompt_ids``) and route by it with ``prefix_affinity`` (``bench.group_engine``).
    """
    if execution == "continuous":
        base, _ = parse_policy(policy)
        params = {"threshold": DEFAULT_THRESHOLD, **(params or {})}
        run_limits = engine_limits(base, limits, max_rows)
        learnt = OnlineStepCost() if learnt_step_cost and base not in ENGINE_SCHEDULERS else None
        sched = make_scheduler(base, memory, time_model, run_limits, params, max_input_tokens,  # type: ignore[arg-type]
                               max_tokens_limit, headroom, group_frac, max_preemptions, marginal_cost, learnt,
                               prefix_caching, prefix_affinity)
        res = simulate_continuous(requests, policy, sched, memory, time_model, instances, run_limits,  # type: ignore[arg-type]
                                  progress, preemption, link, host_pages, online, bound_limits=limits,
                                  step_observer=learnt.observe if learnt is not None else None)
        res.extra["step_cost"] = "learnt" if learnt is not None else "roofline"
        res.extra["params"] = dict(params)
        return res
    t0 = time.perf_counter()
    if execution not in EXECUTIONS or oom_recovery not in RECOVERIES:
        raise ValueError(f"execution in {SIM_EXECUTIONS}, oom_recovery in {RECOVERIES}")
    elastic = execution == "elastic"
    base, _ = parse_policy(policy)
    ctx = PolicyContext(memory=planning_memory(base, memory, headroom), estimator=estimator or time_model,
                        max_input_tokens=max_input_tokens, max_tokens_limit=max_tokens_limit, elastic=elastic)
    params = {"threshold": DEFAULT_THRESHOLD, **(params or {})}
    pol = make_policy(base, ctx, **params)

    book = TraceBook(requests, progress)
    n, index, first, settle = len(requests), book.index, book.first, book.settle
    arrival, order = book.arrival, book.order

    budget = memory.theta_tokens
    idle = instances
    # (time, seq, kind, payload): kind "end" = a run ends (payload: batch, its SimBatchRun),
    # "back" = a preempted row re-enters the policy (payload: the continuation)
    heap: list[tuple[float, int, str, Any]] = []
    seq = 0
    sizes: list[int] = []
    stats = {"padded": 0.0, "busy": 0.0, "sum_gb": 0, "sum_lb": 0, "wma": 0, "ooms": 0, "preemptions": 0,
             "recomputed": 0, "decoded": 0, "wasted": 0, "batches": 0}
    i = 0
    now = 0.0

    def dispatch(now: float) -> None:
        nonlocal idle, seq
        while idle > 0:
            b = pol.pop(now)
            if b is None:
                return
            reqs = b.requests
            for r in reqs:
                book.dispatched(index[r.id], now)
            run = simulate_batch_run([r.input_tokens for r in reqs], [r.true_tokens for r in reqs],
                                     [r.predicted_tokens for r in reqs], [r.preemptions for r in reqs], budget,
                                     time_model, execution, oom_recovery, max_preemptions)
            stats["batches"] += 1
            stats["busy"] += run.end
            stats["decoded"] += run.decoded
            stats["wasted"] += run.wasted
            if elastic:   # every kept row-step is a real token: padding rows left with their requests
                stats["padded"] += run.decoded - run.wasted
            for k, at in run.finished:
                j = index[reqs[k].id]
                first[j] = min(first[j], now + run.first_token)
                settle(j, now + at, True)
            for k, at in run.failed:
                settle(index[reqs[k].id], now + at, False)
            for k, kept, at in run.evicted:
                if kept:
                    j = index[reqs[k].id]
                    first[j] = min(first[j], now + run.first_token)
                stats["preemptions"] += 1
                stats["recomputed"] += kept
                heapq.heappush(heap, (now + at, seq, "back", continuation(reqs[k], kept, now + run.first_token)))
                seq += 1
            heapq.heappush(heap, (now + run.end, seq, "end", (b, run)))
            seq += 1
            idle -= 1

    def ended(b: Batch, run: SimBatchRun, now: float) -> None:
        if run.split is not None:
            part = b if len(run.split) == b.size else Batch(
                id=b.id, requests=[b.requests[k] for k in run.split], created=b.created, attempt=b.attempt,
                splits=b.splits)
            try:
                halves = split_batch(part)
            except UnsplittableBatch:
                if b.size > 1:      # a row left alone by elastic departures restarts without their padding
                    stats["ooms"] += 1
                    pol.requeue(part, now)
                else:
                    settle(index[part.requests[0].id], now, False)
            else:
                stats["ooms"] += 1
                for h in halves:
                    pol.requeue(h, now)
            if not elastic:
                return
        reqs = b.requests
        done = [k for k, _ in run.finished]
        if not done:
            return
        lengths = [(reqs[k].input_tokens, reqs[k].true_tokens) for k in done]
        G_B = max(g for _, g in lengths)
        sizes.append(b.size)
        stats["sum_gb"] += G_B
        stats["sum_lb"] += max(x for x, _ in lengths)
        if elastic:   # rows leave when done: only the prompt padding is wasted (WMA_gen)
            L_B = b.input_len
            stats["wma"] += sum(wma_gen(x, g, L_B) for x, g in lengths)
        else:
            stats["padded"] += b.size * G_B
            stats["wma"] += total_wma(lengths)

    while i < n or heap:
        t_arr = arrival[order[i]] if i < n else math.inf
        if heap and heap[0][0] < t_arr:
            now, _, kind, payload = heapq.heappop(heap)
            if kind == "end":
                idle += 1
                ended(*payload, now)
            else:
                pol.add(payload, now)
        else:
            now = float(t_arr)
            pol.add(requests[order[i]], now)
            i += 1
        if idle > 0:
            dispatch(now)

    metrics = book.metrics(sizes, stats["padded"], stats["wma"], stats["ooms"], preemptions=stats["preemptions"],
                           wasted_tokens=stats["wasted"], decoded_tokens=stats["decoded"],
                           recomputed_tokens=stats["recomputed"])
    nb = max(1, len(sizes))
    return SimResult(policy, metrics, time.perf_counter() - t0, stats["batches"], now,
                     {"params": dict(params), "execution": execution, "oom_recovery": oom_recovery,
                      "busy_frac": stats["busy"] / (instances * now) if now else 0.0,
                      "mean_batch_gen_len": stats["sum_gb"] / nb, "mean_batch_input_len": stats["sum_lb"] / nb})
