"""Split-conformal upper quantiles for any length predictor ("how long could this answer get?").

Why: the batcher packs batches right up to the KV budget Θ, so every under-prediction of a point
estimate is a memory overflow. Memory planning therefore uses an *upper* quantile (q90 by default)
while grouping keeps using the point value. The quantile comes from split-conformal prediction:
on rows the model did **not** train on (a seeded calibration holdout of the training split), the
score ``s = log1p(actual) − log1p(point)`` is computed, and the upper bound of a new request is
``expm1(log1p(point) + q)`` where ``q`` is the ⌈(n+1)·level⌉-th smallest score of its group. A
log-ratio score because lengths span 1–2,000 tokens: an error of 20 tokens is small for a code
translation and huge for a detox rewrite.

Groups (Mondrian conformal), so coverage holds per task and not just on the mix: the item's
``task`` when the table knows it, else its application ``instruction`` (an application repeats its
instruction, so the gateway can calibrate per application without being told the task), else the
global group. A group needs ``min_rows`` calibration rows of its own.

The table is a few numbers per group, stored as ``conformal.json`` next to the model (so it is
versioned with it and replaced whenever the model is retrained).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from predictor.base import PredictItem

CONFORMAL_FILE = "conformal.json"
DEFAULT_LEVEL = 0.9
MIN_GROUP_ROWS = 30
MIN_GROUP_CAL = 200  # calibration rows wanted per task, where the task can spare them
MAX_GROUP_CAL_FRAC = 0.3
GLOBAL = "*"


def instruction_key(instruction: str) -> str:
    """Group key of an application instruction (a digest: the table must not store prompts)."""
    return "instr:" + hashlib.blake2b(instruction.encode("utf-8"), digest_size=8).hexdigest()


def task_key(task: str) -> str:
    return "task:" + task


def conformal_quantile(scores: np.ndarray, level: float) -> float:
    """The split-conformal quantile: the ⌈(n+1)·level⌉-th smallest score (+inf when n is too small
    for that rank to exist, i.e. no finite bound has the guarantee)."""
    s = np.sort(np.asarray(scores, dtype=float))
    k = math.ceil((len(s) + 1) * level)
    return float(s[k - 1]) if 1 <= k <= len(s) else math.inf


def scores(actual: np.ndarray, point: np.ndarray) -> np.ndarray:
    """Non-conformity score: how far above the point estimate the actual length was, in log space."""
    return np.log1p(np.maximum(np.asarray(actual, float), 0)) - np.log1p(np.maximum(np.asarray(point, float), 0))


@dataclass
class ConformalTable:
    """Per-group conformal quantiles of the log-ratio score, at one coverage ``level``."""

    level: float = DEFAULT_LEVEL
    quantiles: dict[str, float] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)

    @classmethod
    def fit(cls, items: Sequence[PredictItem], actual: np.ndarray, point: np.ndarray,
            level: float = DEFAULT_LEVEL, min_rows: int = MIN_GROUP_ROWS) -> ConformalTable:
        """Calibrate on rows the model did not train on: ``point`` = its predictions for them."""
        s = scores(actual, point)
        groups: dict[str, list[int]] = {GLOBAL: list(range(len(items)))}
        for i, it in enumerate(items):
            if it.task:
                groups.setdefault(task_key(it.task), []).append(i)
            groups.setdefault(instruction_key(it.instruction), []).append(i)
        table = cls(level=level)
        for g, idx in groups.items():
            if len(idx) < min_rows and g != GLOBAL:
                continue
            q = conformal_quantile(s[idx], level)
            if math.isfinite(q):
                table.quantiles[g] = q
                table.counts[g] = len(idx)
        return table

    def group_of(self, item: PredictItem) -> str:
        """task → instruction → global, whichever the table has calibrated."""
        if item.task and task_key(item.task) in self.quantiles:
            return task_key(item.task)
        key = instruction_key(item.instruction)
        return key if key in self.quantiles else GLOBAL

    def upper(self, items: Sequence[PredictItem], point: np.ndarray) -> np.ndarray:
        """Upper ``level`` quantile of the generation length for each item, ≥ its point value.
        Without any calibrated group (empty table) the bound is +inf: callers clamp to max_tokens."""
        q = np.array([self.quantiles.get(self.group_of(it), math.inf) for it in items], dtype=float)
        up = np.expm1(np.log1p(np.maximum(np.asarray(point, float), 0)) + np.maximum(q, 0.0))
        return np.maximum(up, np.asarray(point, float))

    def to_dict(self) -> dict[str, Any]:
        return {"level": self.level, "score": "log1p(actual) - log1p(point)",
                "quantiles": self.quantiles, "counts": self.counts}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ConformalTable:
        return cls(level=float(d["level"]), quantiles={k: float(v) for k, v in d["quantiles"].items()},
                   counts={k: int(v) for k, v in d.get("counts", {}).items()})

    def save(self, directory: str | Path) -> None:
        Path(directory, CONFORMAL_FILE).write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def load(cls, directory: str | Path) -> ConformalTable | None:
        path = Path(directory, CONFORMAL_FILE)
        return cls.from_dict(json.loads(path.read_text())) if path.is_file() else None


def calibration_split(items: Sequence[PredictItem], frac: float, seed: int = 0,
                      min_group_cal: int = MIN_GROUP_CAL) -> tuple[np.ndarray, np.ndarray]:
    """(fit rows, calibration rows) of a training set, stratified by task (else instruction).

    Each group gives ``frac`` of its rows, but at least ``min_group_cal`` (capped at 30 % of the
    group): a small task's quantile from 90 rows wobbles by ±3 points of coverage, from 200 by ±2.
    Groups too small to spare ``MIN_GROUP_ROWS`` rows give none (they fall back to the global
    quantile). Seeded, so retraining on the same rows calibrates on the same holdout."""
    if frac <= 0:
        return np.arange(len(items)), np.zeros(0, dtype=int)
    groups: dict[str, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(it.task or instruction_key(it.instruction), []).append(i)
    rng = np.random.default_rng(seed)
    cal: list[int] = []
    for idx in groups.values():
        n = len(idx)
        k = max(int(round(n * frac)), min(min_group_cal, int(n * MAX_GROUP_CAL_FRAC)))
        if k >= MIN_GROUP_ROWS:
            cal.extend(rng.permutation(idx)[:k].tolist())
    cal_idx = np.sort(np.asarray(cal, dtype=int))
    fit_idx = np.setdiff1d(np.arange(len(items)), cal_idx)
    return fit_idx, cal_idx


def coverage(actual: np.ndarray, upper: np.ndarray) -> float | None:
    """Share of requests whose actual length is ≤ the upper bound (None when there are none)."""
    a, u = np.asarray(actual, float), np.asarray(upper, float)
    return float(np.mean(a <= u)) if a.size else None


def predict_bounds(model: Any, items: Sequence[PredictItem], point: np.ndarray | None = None
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    """(point, upper) for ``items``: upper is None when the model carries no conformal table."""
    p = np.asarray(model.predict(list(items)) if point is None else point, dtype=float)
    table: ConformalTable | None = getattr(model, "conformal", None)
    return p, (None if table is None else table.upper(items, p))
