"""The compiled forest answers what scikit-learn's regressor answers, bit for bit; the semantic
predictor's compiled path (forest and term-by-term ridge) answers what its scikit-learn path does."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.ensemble import HistGradientBoostingRegressor, RandomForestRegressor

from predictor.base import PredictItem
from predictor.forest import COMPILED_ROWS, compile_forest, compile_random_forest
from predictor.semantic import SemanticPredictor


@pytest.mark.parametrize("loss", ["squared_error", "poisson"])
def test_compiled_forest_equals_the_regressor_with_missing_values(loss):
    rng = np.random.default_rng(1)
    x = rng.random((400, 12)).astype(np.float32)
    x[rng.random(x.shape) < 0.08] = np.nan  # NaN routes by each split's missing_go_to_left
    y = np.nansum(x[:, :4], axis=1) * 3 + rng.random(400) + 0.1
    model = HistGradientBoostingRegressor(loss=loss, max_iter=15, max_leaf_nodes=31, random_state=0).fit(x, y)
    forest = compile_forest(model)
    assert forest is not None
    queries = rng.random((100, 12)).astype(np.float32)
    queries[rng.random(queries.shape) < 0.1] = np.nan
    queries[:5] = x[:5]  # thresholds are met exactly by training values
    for n in (1, 2, 100):
        assert np.array_equal(forest.predict(queries[:n]), model.predict(queries[:n]))


def test_categorical_splits_are_left_to_the_regressor():
    rng = np.random.default_rng(2)
    x = np.column_stack([rng.integers(0, 5, 300), rng.random(300)])
    model = HistGradientBoostingRegressor(max_iter=5, categorical_features=[0]).fit(x, x[:, 0] * 2 + x[:, 1])
    assert compile_forest(model) is None


@pytest.mark.slow  # loads the static MiniLM vectors and fits a semantic model: seconds
def test_the_semantic_predictor_answers_alike_on_both_paths(tmp_path):
    items = [PredictItem(f"Translate sentence number {i} into French", "word " * (i % 17), 5 + i % 17, "t")
             for i in range(120)]
    targets = [10 + (i % 17) * 4 for i in range(120)]
    model = SemanticPredictor(max_iter=30).fit(items, targets)
    assert model._compiled is not None
    assert model._linear is not None
    small = [model.predict([it])[0] for it in items[:COMPILED_ROWS]]  # compiled path, row by row
    whole = model.predict(items)  # more than COMPILED_ROWS rows: scikit-learn's path
    # the ridge's estimate differs in its last float32 digits (tfidf_ridge), so not bit for bit
    assert np.allclose(np.array(small), whole[:COMPILED_ROWS], rtol=1e-5)
    model.save(tmp_path / "m")
    loaded = SemanticPredictor.load(tmp_path / "m")
    assert loaded._compiled is not None and loaded._linear is not None
    assert np.allclose(loaded.predict(items[:3]), whole[:3], rtol=1e-5)


@pytest.mark.parametrize("missing", [False, True])
def test_the_compiled_random_forest_equals_scikit_learns(missing):
    rng = np.random.default_rng(3)
    x = rng.random((300, 9))  # float64: the trees read it as float32, so must the walk
    if missing:
        x[rng.random(x.shape) < 0.05] = np.nan
    y = np.nansum(x[:, :3], axis=1) * 40 + rng.random(300)
    model = RandomForestRegressor(n_estimators=25, min_samples_leaf=2, random_state=0).fit(x, y)
    forest = compile_random_forest(model)
    assert forest is not None
    queries = np.vstack([rng.random((60, 9)), x[:10]])  # training rows sit on thresholds
    if missing:
        queries[rng.random(queries.shape) < 0.05] = np.nan
    for n in (1, 2, len(queries)):
        assert np.array_equal(forest.predict(queries[:n]), model.predict(queries[:n]))


def test_magnus_answers_alike_compiled_and_after_a_refit(tmp_path):
    from predictor.magnus import MagnusPredictor

    rng = np.random.default_rng(4)
    x, y = rng.random((200, 7)), rng.random(200) * 100
    model = MagnusPredictor(n_estimators=10).fit([], y, features=x)
    assert model._compiled is not None
    # Magnus predicts with n_jobs=-1: threads add the trees in any order, so the last bit may differ
    np.testing.assert_allclose(model.predict_features(x[:3]), model.model.predict(x[:3]), rtol=1e-12)
    model.fit([], y[::-1], features=x)  # refitted in place: the walk follows
    np.testing.assert_allclose(model.predict_features(x[:3]), model.model.predict(x[:3]), rtol=1e-12)
    model.save(tmp_path / "m")
    loaded = MagnusPredictor.load(tmp_path / "m")
    assert loaded._compiled is not None
    np.testing.assert_allclose(loaded.predict_features(x[:3]), model.model.predict(x[:3]), rtol=1e-12)
