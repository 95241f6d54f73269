"""The ranking length predictor ("semantic"): what the request asks for, not only how long it is.

Why this design (numbers in docs/notes/predictors.md):
- Magnus compresses each 384-d sentence vector into 16 (user) + 4 (application) group sums, which
  keeps the *size* of a text but throws away what it asks for. On general instruction traffic
  (Alpaca) the words of the instruction ("write a story", "list five", "classify", "in one word")
  decide the answer's length. Two parts, stacked:
  1. a ridge regression on TF-IDF word n-grams of the instruction (1–2-grams) and of the input
     (words) plus shape features → log length. It sees every word, trains in seconds;
  2. histogram gradient boosting on [its log-length estimate, the full 384-d static MiniLM vectors
     of instruction and input, shape features] → log length. It adds the non-linear part (input
     length on code/translation tasks, interactions). During training the ridge feature is
     out-of-fold (5 folds), so the trees see estimates as noisy as at serving time.
- Vectors are MiniLM's static token embeddings (``predictor.magnus_fast.static_encode``: a
  tokenizer call and a gather, thousands of texts/s on 2 cores), so the gateway can use this model
  as its default; instruction vectors are cached per distinct instruction (applications repeat it).
- Targets are ``log1p(length)``: lengths span 1–2,000 tokens with a long tail, the log makes errors
  relative (ranking short vs long answers is what scheduling needs) and its back-transform is a
  median-like estimate (MAE-friendly).
Stored with skops (sklearn types only), like Magnus.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import scipy.sparse as sp
from sklearn.base import clone
from sklearn.ensemble import HistGradientBoostingRegressor
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge
from sklearn.model_selection import KFold

from predictor import safe_io
from predictor.base import META_FILE, PredictItem
from predictor.forest import COMPILED_ROWS, CompiledForest, compile_forest
from predictor.magnus_fast import static_encode
from predictor.tfidf_ridge import TfidfRidge, compile_tfidf_ridge

PARTS = ("tfidf_instruction", "tfidf_input", "ridge", "model")  # one skops file each
INSTRUCTION_CACHE = 4096
SHAPE_COLUMNS = 4


def shape_features(items: Sequence[PredictItem]) -> np.ndarray:
    """[log1p(input tokens), words of instruction, words of input, input present] per item
    (``SHAPE_COLUMNS`` columns)."""
    return np.array([[np.log1p(it.input_tokens), len(it.instruction.split()), len(it.user_input.split()),
                      float(bool(it.user_input.strip()))] for it in items], dtype=np.float32)


class SemanticPredictor:
    """TF-IDF ridge → (+ static vectors) gradient boosting, on log1p(length). See the module docstring."""

    kind = "semantic"

    def __init__(self, encoder_path: str | None = None, max_iter: int = 300, learning_rate: float = 0.08,
                 max_leaf_nodes: int = 63, min_samples_leaf: int = 20, l2_regularization: float = 1.0,
                 ridge_alpha: float = 3.0, seed: int = 0) -> None:

        self.encoder_path = encoder_path
        self.seed = seed
        self.tfidf_instruction = TfidfVectorizer(ngram_range=(1, 2), min_df=2, max_features=200_000,
                                                 sublinear_tf=True, dtype=np.float32)
        self.tfidf_input = TfidfVectorizer(ngram_range=(1, 1), min_df=2, max_features=50_000,
                                           sublinear_tf=True, dtype=np.float32)
        self.ridge = Ridge(alpha=ridge_alpha)
        self.model = HistGradientBoostingRegressor(
            max_iter=max_iter, learning_rate=learning_rate, max_leaf_nodes=max_leaf_nodes,
            min_samples_leaf=min_samples_leaf, l2_regularization=l2_regularization, early_stopping=False,
            random_state=seed)
        self._instr_cache: OrderedDict[str, np.ndarray] = OrderedDict()
        self._compiled: CompiledForest | None = None  # the boosting, compiled after fit or load
        self._linear: TfidfRidge | None = None  # the ridge over TF-IDF, term by term, after fit or load

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

    def _sparse(self, items: Sequence[PredictItem], shape: np.ndarray):
        return sp.hstack([self.tfidf_instruction.transform([it.instruction for it in items]),
                          self.tfidf_input.transform([it.user_input for it in items]),
                          sp.csr_matrix(shape)]).tocsr()

    def _dense(self, items: Sequence[PredictItem], shape: np.ndarray, ridge_est: np.ndarray) -> np.ndarray:
        user = static_encode([it.user_input for it in items], self.encoder_path)
        app = self._instruction_vectors([it.instruction for it in items])
        return np.hstack([ridge_est.reshape(-1, 1), app, user, shape]).astype(np.float32)

    def fit(self, items: Sequence[PredictItem], targets: Sequence[float]) -> SemanticPredictor:
        y = np.log1p(np.maximum(np.asarray(targets, dtype=float), 0.0))
        shape = shape_features(items)
        self.tfidf_instruction.fit([it.instruction for it in items])
        self.tfidf_input.fit([it.user_input for it in items])
        sparse = self._sparse(items, shape)
        oof = np.zeros(len(items))
        folds = KFold(n_splits=5, shuffle=True, random_state=self.seed) if len(items) >= 10 else None
        if folds is not None:
            for tr, te in folds.split(sparse):
                oof[te] = clone(self.ridge).fit(sparse[tr], y[tr]).predict(sparse[te])
        self.ridge.fit(sparse, y)
        if folds is None:
            oof = self.ridge.predict(sparse)
        # continuous learning starts from a few dozen logged rows: a leaf of 20 would leave the
        # boosting no split at all, so small training sets get proportionally small leaves
        leaf = self.model.get_params()["min_samples_leaf"]
        self.model.set_params(min_samples_leaf=max(2, min(leaf, len(items) // 10)))
        self.model.fit(self._dense(items, shape, oof), y)
        self.model.set_params(min_samples_leaf=leaf)
        self._compile()
        return self

    def _compile(self) -> None:
        """The fast forms of the fitted parts, for the gateway's few rows at a time."""
        self._compiled = compile_forest(self.model)
        self._linear = compile_tfidf_ridge((self.tfidf_instruction, self.tfidf_input), self.ridge, SHAPE_COLUMNS)

    def predict(self, items: Sequence[PredictItem]) -> np.ndarray:
        if not items:
            return np.zeros(0)
        shape = shape_features(items)
        # the gateway's one or two requests at a time: the compiled forms; a big batch: sklearn's
        small = len(items) <= COMPILED_ROWS
        if small and self._linear is not None:
            ridge_est = self._linear.predict(([it.instruction for it in items], [it.user_input for it in items]), shape)
        else:
            ridge_est = self.ridge.predict(self._sparse(items, shape))
        dense = self._dense(items, shape, ridge_est)
        log_tokens = self._compiled.predict(dense) if small and self._compiled is not None else self.model.predict(dense)
        return np.maximum(np.expm1(log_tokens), 1.0)

    def save(self, directory: Path, meta: dict | None = None) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for name in PARTS:
            safe_io.dump(getattr(self, name), directory / f"{name}.skops")
        info = {"kind": self.kind, "encoder_path": self.encoder_path, "target": "log1p", **(meta or {})}
        (directory / META_FILE).write_text(json.dumps(info, indent=2, default=str))

    @classmethod
    def load(cls, directory: Path) -> SemanticPredictor:
        directory = Path(directory)
        meta = json.loads((directory / META_FILE).read_text())
        if meta.get("kind") != cls.kind:
            raise ValueError(f"{directory}: kind {meta.get('kind')!r} is not {cls.kind!r}")
        self = cls(encoder_path=meta.get("encoder_path"))
        for name in PARTS:
            path = directory / f"{name}.skops"
            setattr(self, name, safe_io.load(path))
        self._compile()
        return self
