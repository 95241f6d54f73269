"""The fastest any scheduler could serve a workload on a fleet: every request alone on an engine
from the moment it arrives (``solo``), timed by the engines' own step model.

Why: a target such as "p50 e2e ≤ 0.5× round-robin's" only means something if it is reachable.
A step never gets shorter when rows join it (the roofline's and a fitted model's coefficients are
non-negative), so no placement, order or admission can give a request a shorter e2e than its solo
run; the solo run's mean, percentiles and goodput, put through the same ``summary`` as a measured
run, bound what any target can reach. Percentiles too: each request's e2e is at least its solo
time, so every order statistic is at least the solo one.

The solo run is optimistic on purpose: its first step computes one prompt token, as if a prefix
cache held the rest (with Llama-3-8B on an H100 a step of 62 prompt tokens, the Magnus prompts'
mean, costs the same as one of a single token: the weights' read dominates both), and it has no
front end, queue or network. Then one decode step per further token.
"""

from __future__ import annotations

import numpy as np

from bench.engine_sim.step_time import StepShape, StepTime
from bench.upstream_bench import StreamResult
from bench.workload import Workload

# What the bound says something about: times and rates. Not the prefix-cache hit rate (the bound's
# engines cache everything) nor anything else a run measures on its engines.
BOUNDED_METRICS = frozenset({"mean_latency_s", "p50_latency_s", "p90_latency_s", "p99_latency_s", "mean_ttft_s",
                             "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "goodput_rps", "throughput_rps"})


def alone_on_engine(step_time: StepTime, prompt_tokens: int, gen_tokens: int) -> tuple[float, float]:
    """(TTFT, e2e) of one request alone on an engine: a first step computing one prompt token
    against the whole prompt's context, then ``gen_tokens − 1`` decode steps."""
    p = max(1, int(prompt_tokens))
    ttft = step_time.seconds(StepShape(prefill_tokens=1, prefill_pairs=p - 0.5, prefill_context=p, prefill_rows=1))
    e2e = ttft + sum(step_time.seconds(StepShape(decode_rows=1, decode_context=p + k))
                     for k in range(1, max(1, int(gen_tokens))))
    return ttft, e2e


def solo_result(workload: Workload, step_time: StepTime, max_tokens: int | None = None) -> StreamResult:
    """The workload served solo (``alone_on_engine``), each request from its arrival, as a run's result
    in the workload's (model) time. Lengths are the true ones, capped at ``max_tokens``."""
    cap = max_tokens or workload.config.max_tokens
    gen = np.minimum(np.maximum(np.asarray(workload.true_tokens, dtype=np.int64), 1), cap)
    times = [alone_on_engine(step_time, int(p), int(g)) for p, g in zip(workload.input_tokens, gen, strict=True)]
    sent = np.asarray(workload.arrival, dtype=float)
    ttft = np.array([t for t, _ in times])
    e2e = np.array([e for _, e in times])
    return StreamResult(sent=sent, first=sent + ttft, done=sent + e2e, tokens=gen, itl_sum=e2e - ttft,
                        ok=np.ones(len(sent), dtype=bool), wall_s=float(np.max(sent + e2e)) if len(sent) else 0.0,
                        errors={})
