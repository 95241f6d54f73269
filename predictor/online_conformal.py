"""Online recalibration of the upper quantile from completions as they arrive.

Why: the split-conformal table (``predictor.conformal``) is calibrated once, on rows like the
training data. On traffic the model never saw its log-ratio scores are larger (an Alpaca-trained
model under-predicts code answers), so the q90 bound covered 66 % of new rows instead of 90 %, and
one row in three outgrew its memory plan. Coverage has to come back by itself, from the lengths
the model actually produces, within a few hundred completions.

The rule, per group (model pool × task, else pool × application instruction, then pool × prompt
cluster where ``predictor.prompt_clusters`` has one, else pool-wide):
- a **rolling window** of the last ``window`` scores ``s = log1p(actual) − log1p(point)`` (the
  same score as the static table, so the two agree on what "covered" means);
- **adaptive conformal inference** (Gibbs & Candès 2021) on the level: after each completion
  ``α ← α + γ·(α* − err)``, where ``err`` = 1 when the actual length exceeded the bound the row
  was planned with. The bound is the ⌈(n+1)·(1−α)⌉-th smallest window score, the level capped at
  1 − α*/2 (``OnlineConformal.max_level``). The window tracks
  the new score distribution; ACI corrects the lag while the window still holds old scores, and
  its long-run miss rate is α* whatever the traffic does (their Proposition 4.1);
- a group with fewer than ``min_rows`` scores of its own borrows its parent's bound (pool-wide
  online group, the same groups across pools, then the model's static table), so a new task
  starts from the best estimate there is and not from nothing. Every completion updates each of
  its groups with the same miss indicator (the miss of the bound it was planned with).

State is a few hundred floats per group, kept as JSON next to the registry's versions
(``<data_dir>/models/predictor/online_conformal.json``, written atomically) together with the
log-DB cursor it has read up to, so a restarted gateway continues where it stopped. It is not
reset when a new version is activated: the windows describe the current traffic, and a retrained
model that predicts better only makes the bound conservative until its window refreshes.
"""

from __future__ import annotations

import json
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from predictor.base import PredictItem
from predictor.conformal import (
    DEFAULT_LEVEL,
    GLOBAL,
    ConformalTable,
    conformal_quantile,
    instruction_key,
    scores,
    task_key,
)

STATE_FILE = "online_conformal.json"
WINDOW = 250
GAMMA = 0.005  # Gibbs & Candès' step size
MIN_ROWS = 30
MAX_GROUPS = 512  # instruction groups come and go; the least recently updated are dropped (state ≤ ~2.5 MB)


@dataclass
class GroupState:
    """One group's rolling scores and its current miss level α (target α* = 1 − level)."""

    scores: deque[float]
    alpha: float
    seen: int = 0
    misses: int = 0
    touched: int = 0  # update counter at the last update (for eviction)

    def quantile(self, min_rows: int, max_level: float = 1.0) -> float | None:
        """The window's bound at level 1 − α, at most ``max_level`` (None: too few rows; a level at
        or above n/(n+1) gives the largest score, not +inf, so a run of misses never turns memory
        planning off)."""
        n = len(self.scores)
        if n < min_rows:
            return None
        level = min(1.0 - self.alpha, max_level)
        if level >= n / (n + 1):
            return float(max(self.scores))
        return conformal_quantile(np.fromiter(self.scores, float), max(level, 0.0))


@dataclass
class OnlineConformal:
    """Per-group rolling-window + ACI upper quantile on top of a model's static table."""

    level: float = DEFAULT_LEVEL
    window: int = WINDOW
    gamma: float = GAMMA
    min_rows: int = MIN_ROWS
    groups: dict[str, GroupState] = field(default_factory=dict)
    cursor: float = 0.0  # log-DB ``finished`` time read up to (live use)
    updates: int = 0

    # --- groups ---------------------------------------------------------------------------------
    @staticmethod
    def keys(item: PredictItem, pool: str | None = None, cluster: str | None = None) -> tuple[str, ...]:
        """Groups of ``item``, most specific first: (pool × task, else pool × instruction), pool ×
        prompt cluster (``predictor.prompt_clusters``; None: not clustered), pool-wide, then the same
        across pools (a caller that does not name its pool still gets a bound learnt from every
        completion)."""
        own = task_key(item.task) if item.task else instruction_key(item.instruction)
        mine = (own, cluster, GLOBAL) if cluster else (own, GLOBAL)
        shared = tuple(f"|{k}" for k in mine)
        return shared if not pool else (*(f"{pool}|{k}" for k in mine), *shared)

    def _state(self, key: str) -> GroupState:
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = GroupState(deque(maxlen=self.window), 1.0 - self.level)
        return g

    @property
    def max_level(self) -> float:
        """The highest level ACI may plan at: 1 − α*/2 (0.95 for a q90 target).

        Why a cap: after a burst of misses (a new task whose first rows outgrow their borrowed
        bounds, 50 predicted before any completes) α falls to 0 and the bound becomes the window's
        largest score for the hundred-odd rows ACI takes to climb back. On a replay of the eight
        Magnus tasks, in order, the last task was planned at ~1,300 tokens a row for 50 rows
        (static table: 97), and the last 500 rows averaged 241 planned tokens against 81; capped at
        0.95: 120, coverage 0.888 → 0.884; the Alpaca → codealpaca / gpteacher replays, where the
        cap never binds, are unchanged to the last digit (docs/notes/predictors.md)."""
        return 1.0 - (1.0 - self.level) / 2.0

    def group_quantile(self, item: PredictItem, pool: str | None, static: ConformalTable | None,
                       cluster: str | None = None) -> float:
        """The log-ratio bound for ``item``: its first online group with ``min_rows`` scores, else the
        static table."""
        for key in self.keys(item, pool, cluster):
            g = self.groups.get(key)
            q = None if g is None else g.quantile(self.min_rows, self.max_level)
            if q is not None:
                return q
        if static is not None:
            return static.quantiles.get(static.group_of(item), math.inf)
        return math.inf

    # --- the two calls --------------------------------------------------------------------------
    def upper(self, items: Sequence[PredictItem], point: np.ndarray, static: ConformalTable | None = None,
              pool: str | None | Sequence[str | None] = None,
              clusters: Sequence[str | None] | None = None) -> np.ndarray:
        """Current upper bound per item (≥ point; +inf when nothing at all is calibrated).
        ``pool``: one model pool for all items, or one per item; ``clusters``: each item's prompt
        cluster key (None: not clustered)."""
        p = np.maximum(np.asarray(point, float), 0.0)
        pools = _per_item(pool, len(items))
        cls = [None] * len(items) if clusters is None else list(clusters)
        memo: dict[tuple[str, ...], float] = {}  # one window sort per group and call, not per item
        q = np.empty(len(items))
        for i, (it, pl, cl) in enumerate(zip(items, pools, cls, strict=True)):
            keys = (*self.keys(it, pl, cl), static.group_of(it) if static is not None else "")
            if keys not in memo:
                memo[keys] = self.group_quantile(it, pl, static, cl)
            q[i] = memo[keys]
        return np.maximum(np.expm1(np.log1p(p) + np.maximum(q, 0.0)), p)

    def update(self, items: Sequence[PredictItem], point: np.ndarray, actual: np.ndarray,
               upper: np.ndarray | None = None, static: ConformalTable | None = None,
               pool: str | None | Sequence[str | None] = None,
               clusters: Sequence[str | None] | None = None) -> None:
        """Learn from completed rows, in completion order. ``upper`` = the bounds the rows were
        planned with (NaN where unknown, e.g. rows logged before the log DB kept the bound); where
        it is unknown the current bound stands in for it. ``clusters``: as for ``upper``."""
        s = scores(actual, point)
        pools = _per_item(pool, len(items))
        cls = [None] * len(items) if clusters is None else list(clusters)
        for i, it in enumerate(items):
            if upper is None or not np.isfinite(upper[i]):
                bound = float(self.upper([it], np.asarray([point[i]]), static, pools[i], [cls[i]])[0])
            else:
                bound = float(upper[i])
            err = float(float(actual[i]) > bound)
            self.updates += 1
            for key in self.keys(it, pools[i], cls[i]):
                g = self._state(key)
                g.alpha += self.gamma * ((1.0 - self.level) - err)
                g.alpha = min(max(g.alpha, -1.0), 1.0)  # bounded (ACI's α stays in [−γ, 1+γ] anyway)
                g.scores.append(float(s[i]))
                g.seen += 1
                g.misses += int(err)
                g.touched = self.updates
        self._evict()

    def _evict(self) -> None:
        if len(self.groups) <= MAX_GROUPS:
            return
        for key in sorted(self.groups, key=lambda k: self.groups[k].touched)[:len(self.groups) - MAX_GROUPS]:
            del self.groups[key]

    # --- persistence ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "window": self.window, "gamma": self.gamma, "min_rows": self.min_rows,
                "cursor": self.cursor, "updates": self.updates,
                "groups": {k: {"scores": list(g.scores), "alpha": g.alpha, "seen": g.seen, "misses": g.misses,
                               "touched": g.touched} for k, g in self.groups.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any], **override: Any) -> OnlineConformal:
        """Rebuild the state; ``override`` (e.g. a changed window from settings) wins over the file."""
        params = {k: d[k] for k in ("level", "window", "gamma", "min_rows") if k in d}
        params.update({k: v for k, v in override.items() if v is not None})
        self = cls(**params, cursor=float(d.get("cursor", 0.0)), updates=int(d.get("updates", 0)))
        for k, g in d.get("groups", {}).items():
            self.groups[k] = GroupState(deque((float(x) for x in g["scores"]), maxlen=self.window),
                                        float(g["alpha"]), int(g.get("seen", 0)), int(g.get("misses", 0)),
                                        int(g.get("touched", 0)))
        return self

    def save(self, path: str | Path) -> None:
        """Atomic write (temporary file + ``os.replace``): a reader never sees half a state."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(self.to_dict()))
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | Path, **override: Any) -> OnlineConformal | None:
        """The saved state, or None when there is none or it cannot be read (start fresh)."""
        try:
            return cls.from_dict(json.loads(Path(path).read_text()), **override)
        except (OSError, ValueError, KeyError, TypeError):
            return None


def _per_item(pool: str | None | Sequence[str | None], n: int) -> list[str | None]:
    return [pool] * n if pool is None or isinstance(pool, str) else list(pool)
