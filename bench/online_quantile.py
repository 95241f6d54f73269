"""The simulator plans with the *current* upper quantile: the live service's online
recalibration (``predictor.online_conformal.OnlineConformal``), fed by simulated completions.

Why: the live gateway attaches to every request the bound the online quantile gives at that
moment, and learns from each answer as it completes; a simulator that planned with the static q90
table would test a different memory plan than the one the product runs. Here a request gets its
bound when it arrives (``OnlineScheduler.add``, as the gateway does at prediction time) and every
completed request updates the state with the bound it was planned with. The engine settles a row
when it computes the step that finishes it, i.e. up to one step (tens of ms) before that step's
simulated end: a completion can inform a request that arrives within that step. Continuations
(preempted rows) keep the bound their request was planned with, as in the worker.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from bench.continuous import Scheduler, SimInstance, SimRow
from cohort.types import ProfiledRequest
from predictor.base import PredictItem
from predictor.conformal import ConformalTable
from predictor.online_conformal import OnlineConformal


def _item(req: ProfiledRequest) -> PredictItem:
    """The predictor's grouping view of a simulated request (texts are not simulated: the task groups)."""
    return PredictItem(instruction="", user_input="", input_tokens=req.input_tokens, task=req.task)


class OnlineQuantile:
    """One run's online quantile: ``plan`` a request on arrival, ``completed`` when it is answered."""

    def __init__(self, table: ConformalTable | None, state: OnlineConformal | None = None) -> None:
        self.table = table
        self.state = state or OnlineConformal(level=table.level if table is not None else 0.9)
        self.planned: dict[str, int] = {}   # request id -> the bound it was planned with

    def plan(self, req: ProfiledRequest) -> ProfiledRequest:
        """``req`` with its upper bound replaced by the current online one (point ≤ bound ≤ max_tokens)."""
        point = float(req.predicted_tokens)
        bound = float(self.state.upper([_item(req)], np.asarray([point]), self.table)[0])
        upper = int(min(max(round(bound), req.predicted_tokens), req.max_tokens)) if np.isfinite(bound) \
            else req.max_tokens
        self.planned[req.id] = upper
        return replace(req, predicted_upper=upper)

    def completed(self, req: ProfiledRequest) -> None:
        """Learn from one answered request (its true length against the bound it was planned with)."""
        upper = self.planned.pop(req.id, None)
        if upper is None or req.true_tokens is None:
            return
        self.state.update([_item(req)], np.asarray([float(req.predicted_tokens)]),
                          np.asarray([float(req.true_tokens)]), np.asarray([float(upper)]), self.table)


class OnlineScheduler:
    """A scheduler whose arrivals are planned with the online quantile; everything else is ``inner``'s."""

    def __init__(self, inner: Scheduler, online: OnlineQuantile) -> None:
        self.inner = inner
        self.online = online

    def add(self, req: ProfiledRequest, now: float) -> None:
        self.inner.add(self.online.plan(req), now)

    def has_work(self) -> bool:
        return self.inner.has_work()

    def admit(self, inst: SimInstance, now: float, budget: int) -> list[ProfiledRequest]:
        return self.inner.admit(inst, now, budget)

    def swap_in_first(self, inst: SimInstance, now: float) -> bool:
        return self.inner.swap_in_first(inst, now)

    def victim(self, rows: list[SimRow], start: int, now: float) -> int:
        return self.inner.victim(rows, start, now)

    def preempted(self, req: ProfiledRequest, now: float) -> None:
        self.inner.preempted(req, now)
