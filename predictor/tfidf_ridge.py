"""A fitted ridge regression over TF-IDF features, evaluated term by term for a few requests.

Why: the gateway predicts one or two requests at a time. For one request, scikit-learn's path
(each vectorizer's ``transform``, a sparse ``hstack``, ``Ridge.predict``) builds four sparse
matrices and runs its input checks on each: about 1 ms of a 1.9 ms ``semantic`` prediction on
this 2-core host, almost none of it arithmetic. A request's estimate is a sum over the terms it
contains, so here each text is cut into terms by the vectorizer's own analyzer and the weights
are looked up in its vocabulary.

The arithmetic is scikit-learn's (``TfidfTransformer.transform``, then ``Ridge.predict``):
counts (1 for a binary vectorizer), ``1 + log(count)`` when ``sublinear_tf``, times ``idf_``,
scaled to unit l2 or l1 norm, dotted with the ridge's coefficients, plus its intercept. It is
computed in float64 where scikit-learn used the model's float32, so the two agree to about
1e-6 of the estimate, not bit for bit. ``compile_tfidf_ridge`` returns None for any setting it
does not cover (a norm other than l1/l2/none, a multi-output ridge), and the caller keeps
scikit-learn's path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class _Terms:
    """One vectorizer's part of the ridge: its analyzer, vocabulary, idf and coefficients."""

    analyze: Callable[[str], list[str]]  # the vectorizer's own ``build_analyzer()``: text → terms
    vocabulary: dict[str, int]
    idf: list[float] | None  # None: use_idf off
    coef: list[float]  # the ridge's coefficients of this vectorizer's columns
    binary: bool
    sublinear: bool
    norm: str | None

    def dot(self, text: str) -> float:
        counts: dict[int, int] = {}
        vocab = self.vocabulary
        for term in self.analyze(text):
            j = vocab.get(term)
            if j is not None:
                counts[j] = counts.get(j, 0) + 1
        if not counts:
            return 0.0
        total = scale = 0.0
        for j, n in counts.items():
            tf = 1.0 if self.binary else float(n)
            if self.sublinear:
                tf = 1.0 + math.log(tf)
            x = tf * self.idf[j] if self.idf is not None else tf
            total += x * self.coef[j]
            scale += x * x if self.norm == "l2" else abs(x)
        if self.norm is None or scale == 0.0:
            return total
        return total / (math.sqrt(scale) if self.norm == "l2" else scale)


@dataclass(frozen=True)
class TfidfRidge:
    """The ridge's estimate for rows whose features are, in order, each vectorizer's TF-IDF
    columns and then a few dense columns (``SemanticPredictor._sparse``'s layout)."""

    parts: tuple[_Terms, ...]
    dense_coef: np.ndarray  # float64 [dense columns]
    intercept: float

    def predict(self, texts: Sequence[Sequence[str]], dense: np.ndarray) -> np.ndarray:
        """``texts[k][i]``: row i's text for vectorizer k; ``dense``: [rows, dense columns]."""
        out = np.asarray(dense, dtype=np.float64) @ self.dense_coef + self.intercept
        for part, column in zip(self.parts, texts, strict=True):
            out += np.array([part.dot(t) for t in column], dtype=np.float64)
        return out


def compile_tfidf_ridge(vectorizers: Sequence, ridge, n_dense: int) -> TfidfRidge | None:
    """The term-by-term form of a fitted ridge over ``vectorizers``' TF-IDF columns followed by
    ``n_dense`` dense columns, or None where its settings are not covered (see the module)."""
    coef = np.asarray(getattr(ridge, "coef_", np.zeros(0)), dtype=np.float64)
    widths = [len(getattr(v, "vocabulary_", {})) for v in vectorizers]
    if coef.ndim != 1 or coef.shape[0] != sum(widths) + n_dense:
        return None
    parts, start = [], 0
    for v, width in zip(vectorizers, widths, strict=True):
        if v.norm not in ("l1", "l2", None):
            return None
        idf = np.asarray(v.idf_, dtype=np.float64).tolist() if v.use_idf else None
        parts.append(_Terms(v.build_analyzer(), dict(v.vocabulary_), idf, coef[start:start + width].tolist(),
                            bool(v.binary), bool(v.sublinear_tf), v.norm))
        start += width
    intercept = float(np.asarray(getattr(ridge, "intercept_", 0.0)).ravel()[0])
    return TfidfRidge(tuple(parts), coef[start:], intercept)
