"""Fitting the front end (``step_time``: ``f + g · prompt_tokens`` seconds of the engine's core per
request) together with the step time, from what the fit's replay measured.

Why together: on vLLM's CPU build the front end (HTTP, tokenizing, the hop to the engine process)
runs on the engine's core, so it shows up twice in the replay. A run of steps lasts its steps'
time plus the front-end time of every request that arrived during it; fitted without a front end,
that time lands in the step coefficients (mostly the per-prompt ``e``, since a request that
arrives prefills a step later), and the simulator then charges it at the prefill instead of on
arrival, which makes its first tokens early whenever requests queue. And a request that finds the
engine idle waits its front end before its prefill step starts.

So two kinds of samples go into one non-negative, plain least squares (as ``fit``), in the same
columns, the form's features then [arrivals, their prompt tokens]:

* **runs of steps** (``fit_upstream.step_runs_timed``): their steps' summed features, the number
  of requests sent within the run's span and those requests' prompt tokens; y = the run's time;
* **first tokens on an idle engine**: a request after whose sending no other request's token or
  arrival came until its own first token, which was alone in its step (the replay's single
  client, mostly): the lone prefill step's features, 1 and its prompt tokens; y = its TTFT.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from bench.engine_sim.fit import solve_nonnegative
from bench.engine_sim.step_time import FittedStepTime, StepShape

SAME_STEP_S = 0.002        # wall seconds: tokens this close to a first token may share its step
OUTLIER_MADS = 5.0


class TraceLike(Protocol):
    """What a request's trace (``fit_upstream.Trace``) tells: when it was sent, its prompt's
    length, when each token came, whether it finished and whether a chunk carried several tokens."""

    prompt_tokens: int
    sent: float
    times: list[float]
    multi: bool
    ok: bool


@dataclass(frozen=True)
class FrontSample:
    """A span of the engine's time: the steps in it, the requests whose front end ran in it (their
    number and prompt tokens), and how long it took (model seconds)."""

    shapes: tuple[StepShape, ...]
    arrivals: int
    arrival_tokens: int
    seconds: float
    kind: str              # "run" (a run of steps) or "ttft" (a first token on an idle engine)

    def features(self, form: str) -> np.ndarray:
        steps = np.sum([s.features(form) for s in self.shapes], axis=0)
        return np.array([*steps, self.arrivals, self.arrival_tokens], dtype=float)

    def predict(self, fit: FittedStepTime) -> float:
        return sum(map(fit.seconds, self.shapes)) + self.arrivals * fit.f + self.arrival_tokens * fit.g


def front_samples(traces: Sequence[TraceLike], runs: Sequence[tuple[tuple[StepShape, ...], float]],
                  spans: Sequence[tuple[float, float]], scale: float = 1.0,
                  ) -> tuple[list[FrontSample], list[FrontSample]]:
    """The runs of steps (``fit_upstream.step_runs_timed``'s runs and spans) with the arrivals in
    their spans, and the first tokens on an idle engine (module docstring); seconds × ``scale``."""
    sent = sorted((t.sent, t.prompt_tokens) for t in traces)
    sent_t = np.array([s for s, _ in sent])
    cum_tokens = np.concatenate([[0], np.cumsum([p for _, p in sent])])
    out = []
    for (shapes, secs), (lo, hi) in zip(runs, spans, strict=True):
        i, j = np.searchsorted(sent_t, [lo, hi], side="right")
        out.append(FrontSample(shapes, int(j - i), int(cum_tokens[j] - cum_tokens[i]), secs, "run"))
    tokens = np.sort(np.array([t for tr in traces for t in tr.times]))
    ttfts = []
    for tr in traces:
        if not tr.ok or tr.multi or not tr.times:
            continue
        t1 = tr.times[0]
        others = np.searchsorted(tokens, t1 + SAME_STEP_S, side="right") - np.searchsorted(tokens, tr.sent, side="right")
        own = sum(1 for t in tr.times if t <= t1 + SAME_STEP_S)
        arrived = np.searchsorted(sent_t, t1, side="right") - np.searchsorted(sent_t, tr.sent, side="right")
        if others - own == 0 and arrived == 0 and t1 > tr.sent:
            p = tr.prompt_tokens
            step = StepShape(prefill_tokens=p, prefill_pairs=p * p / 2.0, prefill_context=p, prefill_rows=1)
            ttfts.append(FrontSample((step,), 1, p, (t1 - tr.sent) * scale, "ttft"))
    return out, ttfts


def fit_front(samples: Sequence[FrontSample], form: str) -> FittedStepTime:
    """The form's coefficients and the front end's f and g, by one non-negative least squares."""
    k = len(StepShape().features(form)) + 2
    if len(samples) < k:
        raise ValueError(f"need at least {k} samples to fit {k} coefficients, got {len(samples)}")
    x = np.array([s.features(form) for s in samples])
    y = np.array([s.seconds for s in samples])
    return FittedStepTime.of(form, solve_nonnegative(x, y))


def robust_front_fit(runs: list[FrontSample], ttfts: list[FrontSample], form: str,
                     ) -> tuple[FittedStepTime, list[FrontSample]]:
    """``fit_front``, then again without the samples further than ``OUTLIER_MADS`` MADs (of the
    relative residual, each kind apart: a run and a first token are not equally noisy) from the
    first fit; the fit and the samples it kept."""
    fit = fit_front(runs + ttfts, form)
    kept: list[FrontSample] = []
    for group in (runs, ttfts):
        if not group:
            continue
        res = np.array([(s.predict(fit) - s.seconds) / s.seconds for s in group])
        mid = float(np.median(res))
        mad = float(np.median(np.abs(res - mid))) or 1e-9
        kept += [s for s, r in zip(group, res, strict=True) if abs(r - mid) <= OUTLIER_MADS * mad]
    return fit_front(kept, form), kept


def front_errors(fit: FittedStepTime, samples: Sequence[FrontSample]) -> dict[str, Any]:
    """|predicted − measured| / measured (median, p90, mean) for runs of steps (all, decode-only,
    with a prefill) and for first tokens on an idle engine; the signed median of those too (a
    front end too short or too long shows there first)."""
    def stats(sel: list[FrontSample]) -> dict[str, Any]:
        rel = np.array([(s.predict(fit) - s.seconds) / s.seconds for s in sel if s.seconds > 0])
        if not len(rel):
            return {"samples": 0}
        err = np.abs(rel)
        return {"samples": len(err), "median": float(np.median(err)), "p90": float(np.percentile(err, 90)),
                "mean": float(err.mean()), "signed_median": float(np.median(rel))}

    runs = [s for s in samples if s.kind == "run"]
    has_pre = [any(x.prefill_tokens for x in s.shapes) for s in runs]
    return {"all": stats(runs), "decode_only": stats([s for s, p in zip(runs, has_pre, strict=True) if not p]),
            "with_prefill": stats([s for s, p in zip(runs, has_pre, strict=True) if p]),
            "ttft_idle": stats([s for s in samples if s.kind == "ttft"])}
