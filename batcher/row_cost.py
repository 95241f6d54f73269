"""When one more running row stops paying for itself: the continuous engine's marginal-cost rule.

A continuous instance's step gets slower with every row it runs: each row's token goes through
the weights (compute) and reads the row's own context (KV bandwidth), beside a fixed part (the
weight reads, the framework's overhead). While the fixed part dominates, another row is nearly
free throughput. Once the step is bound by the rows themselves, another row adds little
throughput — a row's marginal step cost approaches the mean cost per row — yet slows every other
row's steps; and with shortest-first admission the requests a full running set keeps waiting are
the long ones. So a row joins only while its marginal cost is at most ``limit`` × the mean cost
per row of the running set it joins (the step's *make-up*, not a fixed row count decides).

Measured in the simulator (docs/benchmarks.md "A row cap from the step's make-up"): on V100 /
ChatGLM-6B, compute-bound at ~200 rows, 0.815 binds near 224 rows and takes spf's mean latency
from 0.73 to 0.70x cb-fcfs; on H100 / Llama-7B, bound by its fixed part, it never binds (a fixed
224-row cap cost 0.76 -> 0.86x there); on the CPU worker (tiny model) 64 rows sit at 0.64.

``row_pays`` is the rule; the step cost comes from the roofline in the simulator
(``bench.roofline.RooflineBatchTime.decode_seconds``) and, on a live worker, from its own steps
(``OnlineStepCost``). Pure Python and NumPy: the worker and the simulator share it.
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
    per_row = context_tokens / rows
    full = cost.decode_seconds(rows, per_row * rows)
    less = cost.decode_seconds(rows - 1, per_row * (rows - 1))
    if full is None or less is None or full <= 0:
        return True
    return (full - less) * rows <= limit * full


class OnlineStepCost:
    """A worker's step cost learnt from its own steps: seconds ≈ a + b·tokens + c·kv_tokens, where
    tokens are the step's decode rows plus prefill tokens and kv_tokens the context they attend to.
    Least squares over the steps seen, older ones forgotten geometrically (``decay`` per step), so
    a changed machine or model is followed within a few hundred steps; refitted every ``refit``
    steps. Until ``min_steps`` steps, or when the steps never varied enough to tell the terms
    apart, it answers None."""

    def __init__(self, decay: float = 0.995, min_steps: int = 64, refit: int = 32) -> None:
        self.decay, self.min_steps, self.refit = decay, min_steps, refit
        self._xx = np.zeros((3, 3))
        self._xy = np.zeros(3)
        self.steps = 0
        self._coef: np.ndarray | None = None

    def observe(self, tokens: int, kv_tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        x = np.array([1.0, float(tokens), float(kv_tokens)])
        self._xx = self.decay * self._xx + np.outer(x, x)
        self._xy = self.decay * self._xy + x * seconds
        self.steps += 1
        if self.steps >= self.min_steps and (self._coef is None or self.steps % self.refit == 0):
            self._coef = self._solve()

    def _solve(self) -> np.ndarray | None:
        # scale the columns so a tiny ridge term regularises all three alike
        scale = np.sqrt(np.maximum(np.diag(self._xx), 1e-12))
        a = self._xx / np.outer(scale, scale)
        coef = np.linalg.solve(a + 1e-6 * np.eye(3), self._xy / scale) / scale
        if not np.all(np.isfinite(coef)) or coef[1] < 0 or coef[0] + coef[1] <= 0:
            return None
        coef[2] = max(coef[2], 0.0)
        coef[0] = max(coef[0], 0.0)
        return coef

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of the current fit, or None."""
        return None if self._coef is None else (float(self._coef[0]), float(self._coef[1]), float(self._coef[2]))

    def decode_seconds(self, rows: int, context_tokens: float) -> float | None:
        if self._coef is None:
            return None
        a, b, c = self._coef
        return float(a + b * rows + c * context_tokens)
