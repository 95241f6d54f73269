"""The ranking length predictor ("semantic"): full static sentence vectors + boosted trees on log length.

Why this design (numbers in docs/predictors.md):
- Magnus compresses each 384-d sentence vector into 16 (user) + 4 (application) group sums, which
  keeps the *size* of a text but throws away what it asks for. On general instruction traffic
  (Alpaca) what an instruction asks ("write a story" vs "classify") decides the answer's length, so
  this model keeps all 384 dimensions of both vectors.
- The vectors are MiniLM's static token embeddings (``predictor.magnus_fast.static_encode``: a
  tokenizer call and a gather, thousands of texts/s on 2 cores), so the gateway can use this model
  as its default; instruction vectors are cached per distinct instruction (applications repeat it).
- The head is a histogram gradient-boosting regressor on ``log1p(length)``: lengths span 1–2,000
  tokens with a long tail, the log makes errors relative (ranking short vs long answers is what
  scheduling needs) and its back-transform is a median-like estimate (MAE-friendly).
- A few cheap shape features (log input length, words of instruction and input, empty input)
  carry what the normalised vectors lose.
Stored with skops (sklearn types only), like Magnus.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from predictor.base import PredictItem
from predictor.magnus_fast import static_encode

MODEL_FILE = "model.skops"
META_FILE = "meta.json"
INSTRUCTION_CACHE = 4096


def shape_features(items: Sequence[PredictItem]) -> np.ndarray:
    """[log1p(input tokens), words of instruction, words of input, input present] per item."""
    return np.array([[np.log1p(it.input_tokens), len(it.instruction.split()), len(it.user_input.split()),
                      float(bool(it.user_input.strip()))] for it in items], dtype=np.float32)


class SemanticPredictor:
    """HistGradientBoosting on [instruction vector, input vector, shape features] → log1p(length)."""

    kind = "semantic"

    def __init__(self, encoder_path: str | None = None, max_iter: int = 400, learning_rate: float = 0.08,
                 max_leaf_nodes: int = 63, min_samples_leaf: int = 20, l2_regularization: float = 1.0,
                 seed: int = 0) -> None:
        from sklearn.ensemble import HistGradientBoostingRegressor

        self.encoder_path = encoder_path
        self.model = HistGradientBoostingRegressor(
            max_iter=max_iter, learning_rate=learning_rate, max_leaf_nodes=max_leaf_nodes,
            min_samples_leaf=min_samples_leaf, l2_regularization=l2_regularization, early_stopping=False,
            random_state=seed)
        self._instr_cache: OrderedDict[str, np.ndarray] = OrderedDict()

    def _instruction_vectors(self, instructions: Sequence[str]) -> np.ndarray:
        """One encode per distinct instruction, LRU-bounded: applications repeat their instruction."""
        missing = list(dict.fromkeys(t for t in instructions if t not in self._instr_cache))
        if missing:
            for text, vec in zip(missing, static_encode(missing, self.encoder_path), strict=True):
                self._instr_cache[text] = vec
        out = np.stack([self._instr_cache[t] for t in instructions])
        for t in dict.fromkeys(instructions):
            self._instr_cache.move_to_end(t)
        while len(self._instr_cache) > INSTRUCTION_CACHE:
            self._instr_cache.popitem(last=False)
        return out

    def features(self, items: Sequence[PredictItem]) -> np.ndarray:
        user = static_encode([it.user_input for it in items], self.encoder_path)
        app = self._instruction_vectors([it.instruction for it in items])
        return np.hstack([app, user, shape_features(items)]).astype(np.float32)

    def fit(self, items: Sequence[PredictItem], targets: Sequence[float]) -> SemanticPredictor:
        y = np.log1p(np.maximum(np.asarray(targets, dtype=float), 0.0))
        self.model.fit(self.features(items), y)
        return self

    def predict(self, items: Sequence[PredictItem]) -> np.ndarray:
        if not items:
            return np.zeros(0)
        return np.maximum(np.expm1(self.model.predict(self.features(items))), 1.0)

    def save(self, directory: Path, meta: dict | None = None) -> None:
        import skops.io as sio

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        sio.dump(self.model, directory / MODEL_FILE)
        info = {"kind": self.kind, "encoder_path": self.encoder_path, "target": "log1p", **(meta or {})}
        (directory / META_FILE).write_text(json.dumps(info, indent=2, default=str))

    @classmethod
    def load(cls, directory: Path) -> SemanticPredictor:
        import skops.io as sio

        directory = Path(directory)
        meta = json.loads((directory / META_FILE).read_text())
        if meta.get("kind") != cls.kind:
            raise ValueError(f"{directory}: kind {meta.get('kind')!r} is not {cls.kind!r}")
        path = directory / MODEL_FILE
        untrusted = [t for t in sio.get_untrusted_types(file=path) if not t.startswith("sklearn.")]
        if untrusted:
            raise ValueError(f"{path}: refusing to load unexpected types {untrusted}")
        self = cls(encoder_path=meta.get("encoder_path"))
        self.model = sio.load(path, trusted=sio.get_untrusted_types(file=path))
        return self
