import json

import numpy as np
import pytest

from predictor.estimator import AnalyticBatchTime, KNNBatchTime, load_estimator, save_analytic
from predictor.estimator_service import EstimatorService
from predictor.registry import Registry
from workers.profile import run_profile


def _truth(b, L, G):
    return 0.02 + 1e-5 * b * L + 3e-3 * G + 1e-7 * b * G * (L + G / 2)


def _grid():
    return [(b, L, G) for b in (1, 2, 4, 8, 16) for L in (16, 64, 256) for G in (8, 32, 128)]


@pytest.mark.slow  # 0.74 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_knn_fit_save_load(tmp_path):
    shapes = _grid()
    y = [_truth(*s) for s in shapes]
    knn = KNNBatchTime(n_neighbors=3).fit(shapes, y)
    assert knn.estimate(*shapes[5]) == pytest.approx(y[5])  # an exact repeat returns its own time
    mid = knn.estimate(6, 100, 50)
    assert min(y) < mid < max(y)
    knn.save(tmp_path / "k", meta={"metrics": {"mae_s": 0.0}})
    again = load_estimator(tmp_path / "k")
    assert isinstance(again, KNNBatchTime) and again.n_samples == len(shapes)
    np.testing.assert_allclose(again.estimate_many(shapes[:7]), knn.estimate_many(shapes[:7]))
    assert json.loads((tmp_path / "k" / "meta.json").read_text())["kind"] == "knn"
    # fewer samples than neighbours still works
    assert KNNBatchTime(5).fit([(1, 1, 1), (2, 2, 2)], [1.0, 2.0]).estimate(1, 1, 1) == pytest.approx(1.0)


def test_analytic_roundtrip(tmp_path):
    a = AnalyticBatchTime.fit(_grid(), [_truth(*s) for s in _grid()])
    save_analytic(a, tmp_path / "a")
    b = load_estimator(tmp_path / "a")
    assert b.estimate(4, 64, 32) == pytest.approx(a.estimate(4, 64, 32))


class FakeEngine:
    def __init__(self):
        self.calls = []

    def run_shape(self, size, input_len, gen_len):
        self.calls.append((size, input_len, gen_len))
        return _truth(size, input_len, gen_len)


def test_run_profile_and_estimator_service(settings):
    from predictor.learning import profile_samples_path, retrain_estimator

    eng = FakeEngine()
    out = profile_samples_path(settings)
    samples = run_profile(eng, _grid(), out, show_progress=False)
    assert len(samples) == len(_grid()) and len(eng.calls) == len(_grid()) + 1  # + warm-up
    stored = json.loads(out.read_text())
    assert stored["samples"] == samples and stored["analytic"]["c3"] >= 0
    svc = EstimatorService(settings, reload_interval_s=0.0)
    assert svc.version is None and isinstance(svc.model, AnalyticBatchTime)
    # analytic fitted from the profile: close to the truth
    assert svc.estimate(8, 256, 128) == pytest.approx(_truth(8, 256, 128), rel=0.05)
    res = retrain_estimator(settings)
    assert res["retrained"]
    assert svc.estimate_many([(8, 256, 128)])[0] == pytest.approx(_truth(8, 256, 128))
    assert svc.version == res["version"] and isinstance(svc.model, KNNBatchTime)
    reg = Registry(settings.data_dir, "estimator")
    reg.active_file.unlink()  # no active version any more: back to analytic
    svc.maybe_reload(force=True)
    assert svc.version is None and isinstance(svc.model, AnalyticBatchTime)


def test_knn_estimates_are_remembered_per_shape_and_equal_the_models():
    rng = np.random.default_rng(3)
    shapes = [(int(b), int(i), int(g)) for b, i, g in rng.integers(1, 300, size=(60, 3))]
    est = KNNBatchTime().fit(shapes, rng.random(60) + 0.1)
    queries = [(int(b), int(i), int(g)) for b, i, g in rng.integers(1, 300, size=(40, 3))]
    queries += queries[:10]  # repeats within one call
    first = est.estimate_many(queries)
    direct = np.maximum(est.model.predict(np.asarray(queries, dtype=float)), 1e-4)
    np.testing.assert_allclose(first, direct, rtol=1e-9)
    calls = []
    est._predict = lambda x: calls.append(len(x)) or np.ones(len(x))  # any new query would show
    assert np.array_equal(est.estimate_many(queries[::-1]), first[::-1]) and calls == []
    est.estimate_many([(1000, 1000, 1000)] + queries)
    assert calls == [1]  # only the unseen shape reaches the model
    est.MEMO = 3  # a full memo starts over and still answers every shape
    assert len(est.estimate_many(queries[:5])) == 5


def test_the_numpy_query_equals_scikit_learns_and_survives_save_and_load(tmp_path):
    rng = np.random.default_rng(5)
    shapes = rng.random((500, 3)) * [64, 2000, 512]
    times = rng.random(500) + 0.05
    est = KNNBatchTime().fit([tuple(r) for r in shapes], times)
    queries = np.vstack([rng.random((200, 3)) * [64, 2000, 512], shapes[:20]])  # 20 exact repeats
    ours = est._predict(queries)
    np.testing.assert_allclose(ours, est.model.predict(queries), rtol=1e-9)
    np.testing.assert_allclose(ours[-20:], times[:20], rtol=1e-12)  # a logged shape: its own time
    est.save(tmp_path / "knn")
    again = KNNBatchTime.load(tmp_path / "knn")
    np.testing.assert_allclose(again._predict(queries), ours, rtol=1e-12)
    few = KNNBatchTime(n_neighbors=5).fit([(1, 10, 10), (2, 20, 20)], [1.0, 3.0])  # fewer rows than k
    np.testing.assert_allclose(few._predict(np.array([[1.5, 15, 15], [2, 20, 20]])),
                               few.model.predict(np.array([[1.5, 15, 15], [2, 20, 20]])), rtol=1e-9)


def test_a_refit_forgets_the_remembered_estimates():
    est = KNNBatchTime(n_neighbors=1).fit([(1, 10, 10)], [1.0])
    assert est.estimate(1, 10, 10) == 1.0
    est.fit([(1, 10, 10)], [2.0])
    assert est.estimate(1, 10, 10) == 2.0
