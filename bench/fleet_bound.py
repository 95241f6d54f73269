"""The fastest any scheduler could serve a workload on a fleet: every request alone on an engine
from the moment it arrives (``solo``), timed by the engines' own step model.

Why: a target such as "p50 e2e ≤ 0.5× round-robin's" only means something if it is reachable.
A step never gets shorter when rows join it (the roofline's and a fitted model's coefficients are
non-negative), so no placement, order or admission can give a request a shorter e2e than its solo
run; the solo run's mean, percentiles and goodput, put through the same ``summary`` as a measured
run, bound what any target can reach. Percentiles too: each request's e2e is at least its solo
time, so every order statistic is at least the solo one.

The solo run is optimistic on purpose: it has no front end, queue or network, and its first step
computes only what no prefix cache could have held. A cache holds pages some earlier request
computed, so where the workload knows its prompts' ids (the chat trace: ``shared_tokens``, the
longest prefix each prompt has in common with an earlier one) the first step computes the rest of
the prompt; else it computes one prompt token, as if a cache held all the others (with Llama-3-8B on
an H100 a step of 62 prompt tokens, the Magnus prompts' mean, costs the same as one of a single
token: the weights' read dominates both). Outputs are not counted as cacheable: the simulated
engines' output ids are seeded draws, which no later prompt's text contains. Then one decode step
per further token.
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


def alone_on_engine(step_time: StepTime, prompt_tokens: int, gen_tokens: int,
                    cached: int | None = None) -> tuple[float, float]:
    """(TTFT, e2e) of one request alone on an engine: a first step computing the prompt's tokens
    past its ``cached`` prefix (at most all but one: an engine computes at least the last prompt
    token; ``None``: all but one) against the whole prompt's context, then ``gen_tokens − 1``
    decode steps. One step for the whole rest is the fastest: splitting it adds a step's floor."""
    p = max(1, int(prompt_tokens))
    hit = p - 1 if cached is None else min(max(0, int(cached)), p - 1)
    n = p - hit
    ttft = step_time.seconds(StepShape(prefill_tokens=n, prefill_pairs=n * (hit + n / 2.0), prefill_context=p,
                                       prefill_rows=1))
    e2e = ttft + sum(step_time.seconds(StepShape(decode_rows=1, decode_context=p + k))
                     for k in range(1, max(1, int(gen_tokens))))
    return ttft, e2e


def solo_result(workload: Workload, step_time: StepTime, max_tokens: int | None = None) -> StreamResult:
    """The workload served solo (``alone_on_engine``), each request from its arrival, as a run's result
    in the workload's (model) time. Lengths are the true ones, capped at ``max_tokens``; a workload
    with ``shared_tokens`` (the chat trace) caches only those (module docstring)."""
    cap = max_tokens or workload.config.max_tokens
    gen = np.minimum(np.maximum(np.asarray(workload.true_tokens, dtype=np.int64), 1), cap)
    shared = getattr(workload, "shared_tokens", None)
    cached = [None] * len(gen) if shared is None or len(shared) != len(gen) else [int(x) for x in shared]
    times = [alone_on_engine(step_time, int(p), int(g), c)
             for p, g, c in zip(workload.input_tokens, gen, cached, strict=True)]
    sent = np.asarray(workload.arrival, dtype=float)
    ttft = np.array([t for t, _ in times])
    e2e = np.array([e for _, e in times])
    return StreamResult(sent=sent, first=sent + ttft, done=sent + e2e, tokens=gen, itl_sum=e2e - ttft,
                        ok=np.ones(len(sent), dtype=bool), wall_s=float(np.max(sent + e2e)) if len(sent) else 0.0,
                        errors={})
