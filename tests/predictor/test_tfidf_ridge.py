"""The term-by-term ridge over TF-IDF answers what scikit-learn's transform and predict answer."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
from sklearn.feature_extraction.text import TfidfVectorizer
from sklearn.linear_model import Ridge

from predictor.tfidf_ridge import compile_tfidf_ridge

WORDS = "write list five short story poem translate code java sentence french answer one word explain why".split()


def _texts(rng: np.random.Generator, n: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(0, 14)))) + (" Unseen-Token!" if i % 7 == 0 else "")
            for i in range(n)]


def _fit(rng, **params):
    first, second = _texts(rng, 200), _texts(rng, 200)
    vecs = (TfidfVectorizer(ngram_range=(1, 2), min_df=2, dtype=np.float32, **params).fit(first),
            TfidfVectorizer(min_df=2, dtype=np.float32, **params).fit(second))
    dense = rng.random((200, 3)).astype(np.float32)
    x = sp.hstack([vecs[0].transform(first), vecs[1].transform(second), sp.csr_matrix(dense)]).tocsr()
    y = rng.random(200) * 3 + np.asarray(x.sum(axis=1)).ravel()
    return vecs, Ridge(alpha=2.0).fit(x, y)


@pytest.mark.parametrize("params", [
    {"sublinear_tf": True},                      # the semantic predictor's setting
    {},
    {"binary": True, "norm": "l1"},
    {"use_idf": False, "norm": None},
])
def test_term_by_term_equals_scikit_learn(params):
    rng = np.random.default_rng(0)
    vecs, ridge = _fit(rng, **params)
    fast = compile_tfidf_ridge(vecs, ridge, 3)
    assert fast is not None
    first, second = _texts(rng, 60), _texts(rng, 60)
    first[0], second[0] = "", "nothing here is in the vocabulary"  # rows with no known term
    dense = rng.random((60, 3)).astype(np.float32)
    expected = ridge.predict(sp.hstack([vecs[0].transform(first), vecs[1].transform(second),
                                        sp.csr_matrix(dense)]).tocsr())
    got = np.concatenate([fast.predict(([a], [b]), dense[i:i + 1]) for i, (a, b) in enumerate(zip(first, second, strict=True))])
    assert np.allclose(got, expected, rtol=1e-5, atol=1e-6)
    assert np.allclose(fast.predict((first, second), dense), expected, rtol=1e-5, atol=1e-6)


def test_what_it_does_not_cover_is_left_to_scikit_learn():
    rng = np.random.default_rng(1)
    vecs, ridge = _fit(rng)
    assert compile_tfidf_ridge(vecs, ridge, 4) is None  # the columns do not add up
    two = Ridge().fit(np.ones((4, len(vecs[0].vocabulary_) + len(vecs[1].vocabulary_) + 3)), np.ones((4, 2)))
    assert compile_tfidf_ridge(vecs, two, 3) is None  # two outputs
    vecs[0].set_params(norm="max")
    assert compile_tfidf_ridge(vecs, ridge, 3) is None
