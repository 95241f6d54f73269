"""Fitting the simulator's step time to a running engine (``cohort engine-sim fit``): drive a
replay against it, rebuild its steps from when each token reached the client, fit the linear
forms of ``step_time`` to them.

**The replay.** Closed-loop clients at several concurrencies in turn (``--concurrency``, each level
for its share of ``--duration``); each client sends one streamed completion after another, its
prompt a list of random token ids (a random first id, so no two prompts share a cached prefix) of
a log-uniform length (or, ``--text-prompts``, as many random common words: the server then
tokenizes them as it does a client's text, and that per-request work, on the engine's core in
vLLM's CPU build, is in what the steps are measured to take), its ``max_tokens`` log-uniform too, with ``ignore_eos``, ``stream_interval``
1 and ``return_token_ids`` (a chunk then says how many tokens it carries). Requests start and end
at different times, so steps mix prefills with decodes of every batch size.

**The steps.** An engine emits every row's token of a step together, so the client sees one burst
of chunks per step, a little spread (the server writes one stream after another). A running
row's gap between two tokens is one step (no preemption in a roomy pool). The step that ends
with a row's token at t1, after its token at t0 and before its next at t2, holds the tokens that
arrived within half a step of t1, from t1 − (t1 − t0)/2 to t1 + min(t1 − t0, t2 − t1)/2 (the
nearest to t1 of a row that has two there): a row whose first token is among them prefilled its
prompt in it, every other row decoded one token over its prompt + the tokens before.
One gap alone is a noisy measure of its step: a server late on a busy core delivers two steps'
tokens at once (a gap of ~0 then a double one). So a sample is a *run* of ``RUN_STEPS``
consecutive steps of one row: their shapes and the time from the token before the first to the
last (both forms are linear, so a run's time is the sum of its steps' and fits as one sample;
``fit.fit_step_runs``). Requests whose chunks carried more than one token are left out.
Prompts stay below the engine's per-step token budget when ``--max-prompt`` does, so a prefill is
one step (a chunked one's first part would go unseen).

**The fit.** ``fit.fit_step_runs`` on the samples (plain least squares; ``robust_fit``); samples further than
``OUTLIER_MADS`` median absolute deviations from the first fit (a GC pause, a context switch on a
shared core) are dropped and the form fitted again. The file's coefficients are linear-v2's fitted
together with the front end (``fit_front``: the requests that arrived during each run, and the
first tokens of requests that found the engine idle); both forms without it are kept beside. The engine's ``engine_sim_speedup`` (the
simulator's ``/metrics``) scales wall times to model times, so a sped-up simulator fits to its
model's coefficients.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from bench.engine_sim.fit import fit_errors, fit_step_runs
from bench.engine_sim.fit_front import front_errors, front_samples, robust_front_fit
from bench.engine_sim.step_time import FIT_FORM, FIT_FORM_V2, FittedStepTime, StepShape

OUTLIER_MADS = 5.0
RUN_STEPS = 8
DROPPED_BACKOFF_S = 0.1  # after a request whose connection dropped
FRONT_FIT = "linear-v2+front"   # the chosen fit: linear-v2 and the front end (fit_front)
WORDS = ("the of and to in is for on that with as it at by from this be are was or have an not but all "
         "they we you he she one time year people way day man thing woman life child world school state "
         "family student group country problem hand part place case week company system program question "
         "work number night point home water room mother area money story fact month lot right study book "
         "eye job word business issue side kind head house service friend father power hour game line end").split()


@dataclass
class Trace:
    """One request as the client saw it: its prompt length and each token's arrival (seconds from
    the replay's start), and whether any chunk carried several tokens."""

    prompt_tokens: int
    sent: float
    times: list[float] = field(default_factory=list)
    multi: bool = False
    ok: bool = False


@dataclass
class FitRun:
    traces: list[Trace]
    wall_s: float
    metrics_before: str
    metrics_after: str
    model: str
    max_model_len: int


def load_traces(path: Path) -> list[Trace]:
    """The traces ``fit_upstream(traces_out=...)`` wrote."""
    return [Trace(**d) for d in json.loads(Path(path).read_text())]


# --- the replay --------------------------------------------------------------------------------
def _base(url: str) -> str:
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


async def _one(session: aiohttp.ClientSession, url: str, body: dict[str, Any], tr: Trace, t0: float) -> None:
    """One streamed completion into ``tr``. A request whose connection drops (a server closing a
    kept-alive connection as the client reuses it) stays not ``ok``, like one answered with an
    error: the fit leaves it out, and the replay goes on."""
    tr.sent = time.perf_counter() - t0
    try:
        async with session.post(url, json=body) as r:
            if r.status != 200:
                await r.read()
                return
            async for line in r.content:
                if not line.startswith(b"data:") or line.startswith(b"data: [DONE]"):
                    continue
                now = time.perf_counter() - t0
                d = json.loads(line[5:])
                usage = d.get("usage")
                if usage and usage.get("prompt_tokens"):   # the engine's own count (text prompts)
                    tr.prompt_tokens = int(usage["prompt_tokens"])
                ch = d.get("choices")
                if ch:
                    n = len(ch[0].get("token_ids") or ()) or 1
                    if n > 1:
                        tr.multi = True
                    tr.times.extend([now] * n)
    except (aiohttp.ClientError, asyncio.TimeoutError):
        await asyncio.sleep(DROPPED_BACKOFF_S)  # a server that went away is not asked again at once
        return
    tr.ok = True


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))


async def fit_replay(url: str, duration_s: float = 150.0, concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                     max_prompt: int = 1024, max_output: int = 128, seed: int = 0, vocab: tuple[int, int] = (1000, 8000),
                     timeout_s: float = 300.0, text_prompts: bool = False, warmup_s: float = 0.0) -> FitRun:
    """Closed-loop streamed completions at each concurrency in turn, for ``duration_s`` in all.
    ``text_prompts``: prompts of random common words (the server tokenizes them, as it does a
    client's text; their length is the ``usage`` the server reports) instead of token ids.
    ``warmup_s``: first, that long at the highest concurrency, not recorded: a freshly started
    engine's first seconds can run slower than the rest (lazy set-up), which the first level would
    fit. (On vLLM's CPU build it moved the fit by 2 %: docs/notes/engine_sim_fidelity.md.)"""
    base = _base(url)
    rng = random.Random(seed)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s),
                                     connector=aiohttp.TCPConnector(limit=max(concurrency) + 4)) as session:
        async with session.get(f"{base}/v1/models") as r:
            card = (await r.json())["data"][0]
        model, max_model_len = card["id"], int(card.get("max_model_len") or 2048)
        max_prompt = max(2, min(max_prompt, max_model_len - max_output - 1))
        traces: list[Trace] = []
        t0 = time.perf_counter()
        per_level = duration_s / len(concurrency)

        async def client(end: float, kept: list[Trace]) -> None:
            await asyncio.sleep(rng.uniform(0, 0.05))
            while time.perf_counter() - t0 < end:
                p = _log_uniform(rng, 2, max_prompt)
                prompt: str | list[int] = (" ".join(rng.choice(WORDS) for _ in range(p)) if text_prompts
                                           else [rng.randrange(*vocab) for _ in range(p)])
                body = {"model": model, "prompt": prompt, "max_tokens": _log_uniform(rng, 2, max_output),
                        "ignore_eos": True, "temperature": 0, "stream": True, "stream_interval": 1,
                        "return_token_ids": True, "stream_options": {"include_usage": True}}
                tr = Trace(p, 0.0)
                kept.append(tr)
                await _one(session, f"{base}/v1/completions", body, tr, t0)

        if warmup_s > 0:
            await asyncio.gather(*(client(warmup_s, []) for _ in range(max(concurrency))))
        before = await (await session.get(f"{base}/metrics")).text()
        t0 = time.perf_counter()
        for i, c in enumerate(concurrency):
            end = per_level * (i + 1)
            await asyncio.gather(*(client(end, traces) for _ in range(c)))
        wall = time.perf_counter() - t0
        after = await (await session.get(f"{base}/metrics")).text()
    return FitRun(traces, wall, before, after, model, max_model_len)


# --- the steps ---------------------------------------------------------------------------------
def step_runs(traces: list[Trace], scale: float = 1.0, run_steps: int = RUN_STEPS,
              ) -> tuple[list[tuple[tuple[StepShape, ...], float]], dict[str, int]]:
    """(the shapes of ``run_steps`` consecutive steps of a row, their seconds × ``scale``) for
    every row and run of its decode (module docstring), and counts of what was seen."""
    out, _, why = step_runs_timed(traces, scale, run_steps)
    return out, why


def step_runs_timed(traces: list[Trace], scale: float = 1.0, run_steps: int = RUN_STEPS,
                    ) -> tuple[list[tuple[tuple[StepShape, ...], float]], list[tuple[float, float]], dict[str, int]]:
    """``step_runs``, and each run's span (from its first step's start to its last step's end, in
    the traces' seconds): the front-end fit (``fit_front``) counts the requests that arrived in it."""
    ev = sorted((t, r, j) for r, tr in enumerate(traces) if tr.ok and not tr.multi for j, t in enumerate(tr.times, 1))
    times = np.array([e[0] for e in ev])
    why = {"gaps": 0, "runs": 0, "two_tokens_in_a_window": 0,
           "multi_token_requests": sum(tr.multi for tr in traces)}
    out: list[tuple[tuple[StepShape, ...], float]] = []
    spans: list[tuple[float, float]] = []
    for tr in traces:
        if not tr.ok or tr.multi:
            continue
        for start in range(1, len(tr.times) - run_steps + 1, run_steps):
            shapes = []
            for j in range(start, start + run_steps):
                t0, t1 = tr.times[j - 1], tr.times[j]
                after = (tr.times[j + 1] - t1) if j + 1 < len(tr.times) else t1 - t0
                lo, hi = np.searchsorted(times, [t1 - (t1 - t0) / 2.0, t1 + min(t1 - t0, after) / 2.0], side="right")
                rows: dict[int, int] = {}
                for _, q, k in sorted(ev[lo:hi], key=lambda e: abs(e[0] - t1)):   # the nearest token of each row
                    rows.setdefault(q, k)
                why["gaps"] += 1
                why["two_tokens_in_a_window"] += int(hi - lo > len(rows))
                shapes.append(_shape(traces, rows))
            span = (tr.times[start - 1], tr.times[start + run_steps - 1])
            out.append((tuple(shapes), (span[1] - span[0]) * scale))
            spans.append(span)
    why["runs"] = len(out)
    return out, spans, why


def _shape(traces: list[Trace], rows: dict[int, int]) -> StepShape:
    """The step of these rows, each at its token index: index 1 prefilled the prompt, a later one
    decoded a token over the prompt and the tokens before."""
    pt = pc = dr = dc = pr = 0
    pairs = 0.0
    for q, k in rows.items():
        p = traces[q].prompt_tokens
        if k == 1:
            pt, pc, pr, pairs = pt + p, pc + p, pr + 1, pairs + p * p / 2.0
        else:
            dr, dc = dr + 1, dc + p + k - 1
    return StepShape(pt, pairs, pc, dr, dc, pr)


# --- the fit -----------------------------------------------------------------------------------
Run = tuple[tuple[StepShape, ...], float]


def robust_fit(samples: list[Run], form: str, relative: bool = False) -> tuple[FittedStepTime, list[Run]]:
    """The form fitted, then again without the samples further than ``OUTLIER_MADS`` MADs (of the
    relative residual) from the first fit; the fit and the samples it kept. Plain least squares
    by default: it predicts the mean time of a shape, which is what a replay's latencies add up;
    ``relative`` least squares predicts low where steps are noisy (by about the noise's squared
    coefficient of variation)."""
    fit = fit_step_runs(samples, form, relative=relative)
    res = np.array([(sum(map(fit.seconds, s)) - t) / t for s, t in samples])
    mid = float(np.median(res))
    mad = float(np.median(np.abs(res - mid))) or 1e-9
    kept = [smp for smp, r in zip(samples, res, strict=True) if abs(r - mid) <= OUTLIER_MADS * mad]
    return fit_step_runs(kept, form, relative=relative), kept


def metric_labels(text: str, name: str) -> dict[str, str]:
    """The labels of the first sample of ``name`` in a Prometheus page."""
    m = re.search(rf"^{re.escape(name)}\{{([^}}]*)\}}", text, re.M)
    return dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}


def metric_value(text: str, name: str) -> float | None:
    """The sum of ``name``'s samples in a Prometheus page (None: not there)."""
    vals = [float(v) for v in re.findall(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([-+0-9.eE]+|NaN)$", text, re.M)]
    return sum(vals) if vals else None


def fit_upstream(url: str, duration_s: float = 150.0, concurrency: tuple[int, ...] = (1, 2, 4, 8, 16, 32),
                 max_prompt: int = 1024, max_output: int = 128, seed: int = 0, relative: bool = False,
                 traces_out: Path | None = None, text_prompts: bool = False, warmup_s: float = 0.0) -> dict[str, Any]:
    """The replay, the samples and the fits (both forms without a front end, linear-v2 with one);
    the JSON ``cohort engine-sim fit`` writes: linear-v2's coefficients fitted with the front end's
    ``f`` and ``g`` at its top level (``step_time.load_fit`` reads it as ``--fit``), and in
    ``fit_error`` that fit's errors over every run of steps and idle first token."""
    run = asyncio.run(fit_replay(url, duration_s, concurrency, max_prompt, max_output, seed,
                                 text_prompts=text_prompts, warmup_s=warmup_s))
    if traces_out is not None:   # what the client saw, to fit again offline (load_traces)
        traces_out.write_text(json.dumps([asdict(t) for t in run.traces]))
    speedup = metric_value(run.metrics_after, "engine_sim_speedup") or 1.0
    samples, spans, why = step_runs_timed(run.traces, speedup)
    fits: dict[str, Any] = {}
    for form in (FIT_FORM, FIT_FORM_V2):
        fit, kept = robust_fit(samples, form, relative)
        fits[form] = {"coefficients": fit.to_json(), "samples_kept": len(kept),
                      "error_kept": fit_errors(fit, kept), "error_all": fit_errors(fit, samples)}
    # the chosen fit: linear-v2 with the front end, the runs' arrivals and idle first tokens beside
    # the runs (fit_front); its errors count each run's arrivals' front end in its prediction
    front_runs, ttfts = front_samples(run.traces, samples, spans, speedup)
    chosen, kept_front = robust_front_fit(front_runs, ttfts, FIT_FORM_V2)
    fits[FRONT_FIT] = {"coefficients": chosen.to_json(), "samples_kept": len(kept_front),
                       "idle_first_tokens": len(ttfts), "error_kept": front_errors(chosen, kept_front),
                       "error_all": front_errors(chosen, front_runs + ttfts)}
    pre = metric_value(run.metrics_before, "vllm:num_preemptions_total") or 0.0
    post = metric_value(run.metrics_after, "vllm:num_preemptions_total") or 0.0
    done = [t for t in run.traces if t.ok]
    return {**chosen.to_json(),   # its form: linear-v1 where a_p and e came out 0
            "formula": "t = a + a_p*[prefill] + b*prefill_tokens + e*prefill_rows + c*decode_rows + d*context_tokens",
            "front_end": "f + g*prompt_tokens per request, on the engine's core before it joins the waiting queue",
            "units": "seconds (model seconds: wall x the engine's engine_sim_speedup)",
            "engine": {"url": url, "model": run.model, "max_model_len": run.max_model_len,
                       "cache_config_info": metric_labels(run.metrics_after, "vllm:cache_config_info"),
                       "speedup": speedup, "preemptions_during_fit": post - pre},
            "replay": {"duration_s": duration_s, "warmup_s": warmup_s, "wall_s": run.wall_s, "concurrency": list(concurrency),
                       "max_prompt": max_prompt, "max_output": max_output, "seed": seed,
                       "prompts": "text" if text_prompts else "token ids",
                       "requests": len(run.traces), "done": len(done), "failed": len(run.traces) - len(done),
                       "tokens": sum(len(t.times) for t in done)},
            "samples": len(samples), "run_steps": RUN_STEPS, "least_squares": "relative" if relative else "plain", "steps": why, "fits": fits,
            "fit_error": fits[FRONT_FIT]["error_all"]}
