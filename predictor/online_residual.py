"""Online correction of the point prediction from completions ("notice and recover").

Why: on a new source the model's errors are not only wider (the upper quantile handles that) but
*systematic*: an Alpaca-trained model under-predicts code answers by a roughly constant factor, and
within tool-use prompts the answer grows with the prompt while on Alpaca it shrinks with the input.
Retraining fixes this only after a retrain cycle has enough logged rows; a small linear model of the
residual fitted online fixes most of it within a few hundred completions.

The model: ``log1p(actual) − log1p(point) ≈ w · x`` with ``x`` = [1, log point, shape features,
cross-source cues (``predictor.cues``), 128 hashed words of the request — the instruction's last
line (where a long system-style preamble ends in the actual ask) and the input — and a one-hot of
the request's prompt cluster (``predictor.prompt_clusters``; zeros before the clusters are fitted):
a bias per kind of traffic, which the words of the ask alone do not carry when the kind is named
earlier in the instruction, e.g. the tool a tool-use prompt grants], a ridge regression with exponential forgetting (recursive
least squares in its batch form: ``A ← λA + xxᵀ``, ``b ← λb + x·r``, ``w = (A + αI)⁻¹ b``). The ridge
pulls ``w`` to 0 (no correction) until completions say otherwise, so on traffic the model already
predicts well the correction stays near zero; λ forgets old traffic (effective memory 1/(1−λ) rows).
The state is ``A`` and ``b`` per pool (~200 KB as JSON), saved with the online conformal state,
and reset when a new model version is activated (``follow``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from sklearn.feature_extraction import FeatureHasher
from sklearn.feature_extraction.text import HashingVectorizer

from predictor.base import PredictItem
from predictor.cues import cue_features
from predictor.semantic import shape_features

FORGET = 0.998
RIDGE = 30.0
MIN_ROWS = 100
MAX_SHIFT = 2.5  # the correction never moves a prediction by more than e^2.5 ≈ 12× either way
SHARED = ""
HASHED_WORDS = 128  # measured: +0.015 τ on codealpaca, +0.04 on gpteacher over cues alone (docs/notes/predictors.md)
_WORDS = HashingVectorizer(n_features=HASHED_WORDS, alternate_sign=True, norm="l2")  # stateless: nothing to store
# What _WORDS.transform computes, without its per-call parameter and input validation (3x the
# hashing itself, on every prediction in the gateway): the same words, hasher and l2 norm
_SPLIT_WORDS = _WORDS.build_analyzer()
_HASH_WORDS = FeatureHasher(n_features=HASHED_WORDS, input_type="string", alternate_sign=True)


def hashed_words(texts: Sequence[str]) -> np.ndarray:
    """``_WORDS.transform(texts)`` as a dense array (tested equal)."""
    x = _HASH_WORDS.transform(_SPLIT_WORDS(t) for t in texts).toarray()
    norms = np.sqrt((x * x).sum(axis=1, keepdims=True))
    return x / np.where(norms > 0, norms, 1.0)


def _ask(instruction: str) -> str:
    lines = [line for line in instruction.strip().split("\n") if line.strip()]
    return lines[-1] if lines else instruction


def correction_features(items: Sequence[PredictItem], point: np.ndarray, slots: Sequence[int | None] | None = None,
                        n_slots: int = 0) -> np.ndarray:
    """[1, log1p(point) − 4, shape features, cues, hashed words, cluster one-hot of ``n_slots``] per
    item (centred logs keep the ridge fair). ``slots``: each item's cluster number, None where it
    has none."""
    lp = np.log1p(np.maximum(np.asarray(point, float), 0.0)).reshape(-1, 1) - 4.0
    words = hashed_words([f"{_ask(it.instruction)} {it.user_input}" for it in items])
    onehot = np.zeros((len(items), n_slots))
    for i, slot in enumerate(slots or ()):
        if slot is not None and 0 <= slot < n_slots:
            onehot[i, slot] = 1.0
    return np.hstack([np.ones((len(items), 1)), lp, shape_features(items), cue_features(items), words, onehot])


@dataclass
class OnlineResidual:
    """Forgetting ridge on the log residual, per pool and shared across pools."""

    forget: float = FORGET
    ridge: float = RIDGE
    min_rows: int = MIN_ROWS
    clusters: int = 0  # prompt-cluster slots in the features (``COHORT_ONLINE__CLUSTERS``)
    a: dict[str, np.ndarray] = field(default_factory=dict)
    b: dict[str, np.ndarray] = field(default_factory=dict)
    n: dict[str, float] = field(default_factory=dict)  # forgetting-weighted row count
    version: str | None = None  # the model version the residuals were learnt against
    # w per pool, solved once per update: the solve (a ~150×150 system) on every prediction was
    # 17 % of the gateway's CPU in the soak, for weights that change only when completions arrive
    _w: dict[str, np.ndarray | None] = field(default_factory=dict, repr=False, compare=False)

    def follow(self, version: str | None) -> None:
        """Forget everything when the model version changes: a retrained model has learnt (part of)
        the shift itself, and the old correction on top of it would count the shift twice."""
        if version is not None and version != self.version:
            self.a, self.b, self.n, self.version = {}, {}, {}, version
            self._w = {}

    def _weights(self, key: str) -> np.ndarray | None:
        if key not in self._w:
            if self.n.get(key, 0.0) < self.min_rows:
                self._w[key] = None
            else:
                a = self.a[key]
                self._w[key] = np.linalg.solve(a + self.ridge * np.eye(len(a)), self.b[key])
        return self._w[key]

    def features(self, items: Sequence[PredictItem], point: np.ndarray,
                 slots: Sequence[int | None] | None = None) -> np.ndarray:
        return correction_features(items, point, slots, self.clusters)

    def shift(self, items: Sequence[PredictItem], point: np.ndarray,
              pools: Sequence[str | None] | None = None, x: np.ndarray | None = None,
              slots: Sequence[int | None] | None = None) -> np.ndarray:
        """Log-space correction per item (0 where no pool has ``min_rows`` completions yet)."""
        if not items:
            return np.zeros(0)
        pools = list(pools) if pools is not None else [None] * len(items)
        weights = []  # each item's: its pool's, else the shared one, else none yet
        for pool in pools:
            keys = ([pool] if pool else []) + [SHARED]
            weights.append(next((w for w in map(self._weights, keys) if w is not None), None))
        out = np.zeros(len(items))
        if all(w is None for w in weights):  # nothing learnt yet: no features to compute
            return out
        x = self.features(items, point, slots) if x is None else x
        for i, w in enumerate(weights):
            if w is not None:
                out[i] = float(x[i] @ w)
        return np.clip(out, -MAX_SHIFT, MAX_SHIFT)

    def correct(self, items: Sequence[PredictItem], point: np.ndarray,
                pools: Sequence[str | None] | None = None, slots: Sequence[int | None] | None = None) -> np.ndarray:
        """The corrected point prediction (≥ 1 token)."""
        p = np.asarray(point, float)
        return np.maximum(np.expm1(np.log1p(np.maximum(p, 0.0)) + self.shift(items, p, pools, slots=slots)), 1.0)

    def update(self, items: Sequence[PredictItem], point: np.ndarray, actual: np.ndarray,
               pools: Sequence[str | None] | None = None, slots: Sequence[int | None] | None = None) -> None:
        """Learn from completed rows: ``point`` is the *model's* prediction, before correction."""
        if not items:
            return
        pools = list(pools) if pools is not None else [None] * len(items)
        x = self.features(items, point, slots)
        r = np.log1p(np.maximum(np.asarray(actual, float), 0.0)) - np.log1p(np.maximum(np.asarray(point, float), 0))
        for key in {SHARED, *(p for p in pools if p)}:
            sel = np.array([key == SHARED or p == key for p in pools])
            xs, rs = x[sel], r[sel]
            k = len(xs)
            decay = self.forget ** np.arange(k - 1, -1, -1)  # the newest row weighs most
            a = self.a.get(key, np.zeros((x.shape[1], x.shape[1])))
            b = self.b.get(key, np.zeros(x.shape[1]))
            self.a[key] = (self.forget ** k) * a + (xs * decay[:, None]).T @ xs
            self.b[key] = (self.forget ** k) * b + (xs * decay[:, None]).T @ rs
            self.n[key] = (self.forget ** k) * self.n.get(key, 0.0) + float(decay.sum())
            self._w.pop(key, None)

    def to_dict(self) -> dict[str, Any]:
        return {"forget": self.forget, "ridge": self.ridge, "min_rows": self.min_rows, "clusters": self.clusters,
                "version": self.version,
                "a": {k: v.tolist() for k, v in self.a.items()}, "b": {k: v.tolist() for k, v in self.b.items()},
                "n": dict(self.n)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OnlineResidual:
        self = cls(forget=float(d["forget"]), ridge=float(d["ridge"]), min_rows=int(d["min_rows"]),
                   clusters=int(d.get("clusters", 0)), version=d.get("version"))
        width = self.features([PredictItem("", "", 0)], np.ones(1)).shape[1]
        for k, v in d.get("a", {}).items():
            a = np.asarray(v, float)
            if a.shape == (width, width):  # a state written with other features is dropped, not misread
                self.a[k], self.b[k], self.n[k] = a, np.asarray(d["b"][k], float), float(d["n"][k])
        return self
