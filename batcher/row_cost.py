"""When one more running row stops paying for itself: the continuous engine's marginal-cost rule.

A continuous instance's step gets slower with every row it runs: each row's token goes through
the weights (compute) and reads the row's own context (KV bandwidth), beside a fixed part (the
weight reads, the framework's overhead). While the fixed part dominates, another row is nearly
free throughput. Once the step is bound by the rows themselves, another row adds little
throughput — a row's marginal step cost approaches the mean cost per row — yet slows every other
row's steps; and with shortest-first admission the requests a full running set keeps waiting are
the long ones. So a row joins only while its marginal cost is at most ``limit`` × the mean cost
per row of the running set it joins (the step's *make-up*, not a fixed row count decides).

Measured (docs/notes/benchmarks.md "A row cap from the step's make-up"): on the simulator's V100 /
ChatGLM-6B, compute-bound from ~170 rows, 0.815 binds near 223 rows and takes spf's mean latency
from 0.73 to 0.70x cb-fcfs; on H100 / Llama-7B, bound by its fixed part, it never binds (a fixed
224-row cap cost 0.76 -> 0.86x there); the CPU worker (tiny model) measured its rows paying for
themselves up to ~118, beyond the 64 groups it runs at once.

``row_pays`` is the rule; the step cost comes from the roofline in the simulator
(``bench.roofline.RooflineBatchTime.decode_seconds``) and, on a live worker, from its own steps
(``OnlineStepCost``; a CUDA worker only — on a CPU the step times also measure the processes
sharing its cores, ``workers.engine.LLMEngine.marginal_cost``). Pure Python and NumPy: the worker
and the simulator share it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class DecodeStepCost(Protocol):
    """Seconds of one decode step of ``rows`` rows whose contexts sum to ``context_tokens``
    (None while the cost is not known yet: the rule then does not bind)."""

    def decode_seconds(self, rows: int, context_tokens: float) -> float | None: ...


def row_pays(cost: DecodeStepCost | None, rows: int, context_tokens: int, limit: float) -> bool:
    """May a running set of ``rows`` rows (the joining ones included) with ``context_tokens`` of
    context in all run together? Yes while the last row's marginal decode-step cost is at most
    ``limit`` × the set's mean step cost per row, each row taken at the set's mean context (the
    rule caps how many rows run, it does not rank rows by their prompts). ``limit`` 0: off."""
    if limit <= 0 or cost is None or rows <= 1:
        return True
    full = cost.decode_seconds(rows, context_tokens)
    less = cost.decode_seconds(rows - 1, context_tokens * (rows - 1) / rows)
    if full is None or less is None or full <= 0:
        return True
    return (full - less) * rows <= limit * full


MIN_FIXED_SHARE = 0.01  # a fitted fixed part below this share of the mean step is not trusted


class OnlineStepCost:
    """A worker's step cost learnt from its own steps: seconds ≈ a + b·decode rows + p·prefill
    tokens + c·kv_tokens, kv_tokens being the context the step's tokens attend to. A decode row and
    a prefill token are separate terms: a packed prefill runs its tokens as one matrix product,
    while every decode row has its own attention (and, on a CPU, its own cache lane). Least squares
    over the steps seen, older ones forgotten geometrically (``decay`` per step), so a changed
    machine or model is followed within a few hundred steps; refitted every ``refit`` steps; every
    term is kept non-negative. It answers None until ``min_steps`` steps, and while the steps it
    remembers have not varied their decode rows by at least ``min_row_spread`` (standard
    deviation): with the row count nearly constant — one row for a while — the fixed part and the
    per-row part cannot be told apart, and a guessed split would cap rows on no evidence; and when
    the fit finds no fixed part at all (it would let no second row join)."""

    def __init__(self, decay: float = 0.995, min_steps: int = 64, refit: int = 32, min_row_spread: float = 2.0) -> None:
        self.decay, self.min_steps, self.refit, self.min_row_spread = decay, min_steps, refit, min_row_spread
        self._xx = np.zeros((4, 4))
        self._xy = np.zeros(4)
        self.steps = 0
        self._coef: np.ndarray | None = None

    def observe(self, decode_rows: int, prefill_tokens: int, kv_tokens: int, seconds: float) -> None:
        if decode_rows + prefill_tokens <= 0 or seconds <= 0:
            return
        x = np.array([1.0, float(decode_rows), float(prefill_tokens), float(kv_tokens)])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.steps += 1
        if self.steps >= self.min_steps and (self._coef is None or self.steps % self.refit == 0):
            self._coef = self._solve()

    def row_spread(self) -> float:
        """Standard deviation of the decode rows over the remembered steps (weighted as the fit is)."""
        w = self._xx[0, 0]
        if w <= 0:
            return 0.0
        mean = self._xx[0, 1] / w
        return float(np.sqrt(max(0.0, self._xx[1, 1] / w - mean * mean)))

    def _solve(self) -> np.ndarray | None:
        if self.row_spread() < self.min_row_spread:
            return None
        # no term of a step's cost is negative: a term the unconstrained fit makes negative (noise,
        # or two terms that moved together) is dropped and the rest refitted
        active = [0, 1, 2, 3]
        scale = np.sqrt(np.maximum(np.diag(self._xx), 1e-12))   # so a tiny ridge treats every term alike
        while active:
            idx = np.array(active)
            s = scale[idx]
            xx = self._xx[np.ix_(idx, idx)] / np.outer(s, s)
            sol = np.linalg.solve(xx + 1e-6 * np.eye(len(idx)), self._xy[idx] / s) / s
            if not np.all(np.isfinite(sol)):
                return None
            if sol.min() >= 0:
                coef = np.zeros(4)
                coef[idx] = sol
                # a step with (next to) no fixed part would make every second row cost as much as
                # the first: no engine runs so, and trusting such a fit would stop all batching
                mean_step = self._xy[0] / self._xx[0, 0]
                return coef if coef[0] >= MIN_FIXED_SHARE * mean_step else None
            active.pop(int(np.argmin(sol)))
        return None

    @property
    def coefficients(self) -> tuple[float, float, float, float] | None:
        """(a, b, p, c) of the current fit: fixed, per decode row, per prefill token, per context token."""
        return None if self._coef is None else tuple(float(v) for v in self._coef)  # type: ignore[return-value]

    def decode_seconds(self, rows: int, context_tokens: float) -> float | None:
        if self._coef is None:
            return None
        a, b, _p, c = self._coef
        return float(a + b * rows + c * context_tokens)
