import asyncio
import time

import numpy as np

from predictor.base import PredictItem
from predictor.baselines import LinearLengthPredictor, MeanPredictor
from predictor.registry import Registry
from predictor.service import PredictorService


def _item(n=10):
    return PredictItem("Translate.", "hello " * n, n)


def test_cold_start(settings):
    svc = PredictorService(settings)
    svc.warmup()
    assert svc.version is None
    assert asyncio.run(svc.predict(_item(), 300)) == (300, None)
    svc2 = PredictorService(settings.model_copy(update={"cold_start": "64"}))
    assert asyncio.run(svc2.predict(_item(), 300)) == (64, None)
    assert asyncio.run(svc2.predict(_item(), 20)) == (20, None)  # clamped to max_tokens


class CountingModel:
    kind = "mean"

    def __init__(self):
        self.calls = []

    def predict(self, items):
        self.calls.append(len(items))
        return np.array([float(it.input_tokens) * 2 for it in items])


def test_micro_batching_and_clamp(settings):
    reg = Registry(settings.data_dir, "predictor")
    reg.register_dir(_saved(settings, MeanPredictor(5)))
    svc = PredictorService(settings, max_batch=32, max_wait_s=0.005)
    svc.warmup()
    model = CountingModel()
    svc._swap.current = (model, "vX")

    async def many():
        return await asyncio.gather(*[svc.predict(_item(i + 1), 50) for i in range(100)])

    out = asyncio.run(many())
    assert [o[0] for o in out] == [min(2 * (i + 1), 50) for i in range(100)]
    assert all(o[1] == "vX" for o in out)
    assert sum(model.calls) == 100 and len(model.calls) <= 5  # batched, not one call per request
    assert max(model.calls) == 32


def test_without_a_wait_requests_that_arrive_together_still_share_a_batch_and_one_alone_waits_for_none(settings):
    reg = Registry(settings.data_dir, "predictor")
    reg.register_dir(_saved(settings, MeanPredictor(5)))
    svc = PredictorService(settings)  # the default: no collection wait
    assert svc.max_wait_s == 0
    svc.warmup()
    model = CountingModel()
    svc._swap.current = (model, "vX")

    async def together():
        return await asyncio.gather(*[svc.predict(_item(i + 1), 500) for i in range(40)])

    assert [o[0] for o in asyncio.run(together())] == [2 * (i + 1) for i in range(40)]
    assert model.calls == [40]  # one turn of the loop brought all forty: one call

    async def alone():
        loop = asyncio.get_running_loop()
        t = loop.time()
        await svc.predict(_item(3), 500)
        return loop.time() - t

    assert asyncio.run(alone()) < 0.5 and model.calls == [40, 1]


def _saved(settings, model, name="m"):
    d = settings.data_dir / "src" / name
    model.save(d)
    return d


def _settle(svc: PredictorService, timeout_s: float = 10.0) -> None:
    """Wait for the reload check a prediction starts in the background (``reload_interval_s=0``
    makes every prediction start one): if it ran after the next ``activate`` it would swap the
    version in itself, and the test's own ``maybe_reload`` would find nothing left to do."""
    end = time.monotonic() + timeout_s
    while svc._reloading and time.monotonic() < end:
        time.sleep(0.005)


def test_hot_reload_and_rollback(settings):
    reg = Registry(settings.data_dir, "predictor")
    v1 = reg.register_dir(_saved(settings, MeanPredictor(40), "a"))
    svc = PredictorService(settings, reload_interval_s=0.0)
    svc.warmup()
    assert svc.version == v1
    assert asyncio.run(svc.predict(_item(), 100)) == (40, v1)
    _settle(svc)
    lin = LinearLengthPredictor(1.0, 3.0)
    v2 = reg.register_dir(_saved(settings, lin, "b"))
    assert svc.maybe_reload() and svc.version == v2
    assert asyncio.run(svc.predict(_item(10), 100)) == (31, v2)
    _settle(svc)  # a prediction starts a background check: let it end before ACTIVE changes
    reg.activate(v1)
    assert svc.maybe_reload() and svc.version == v1
    assert not svc.maybe_reload()  # unchanged: nothing to do


def test_predictor_dir_setting(settings):
    d = _saved(settings, MeanPredictor(7), "fixed")
    svc = PredictorService(settings.model_copy(update={"predictor_dir": d}))
    svc.warmup()
    assert svc.version == "fixed"
    assert asyncio.run(svc.predict(_item(), 100)) == (7, "fixed")


def test_failing_model_falls_back_to_cold(settings):
    class Broken:
        kind = "mean"

        def predict(self, items):
            raise RuntimeError("boom")

    svc = PredictorService(settings)
    svc._swap.current = (Broken(), "vB")
    assert asyncio.run(svc.predict(_item(), 77)) == (77, None)


def test_predict_bounds_point_and_upper(settings):
    """A model with a conformal table: the service returns the point value and the upper quantile
    (≥ point, ≤ max_tokens); ``predict`` keeps returning (point, version)."""
    from predictor.conformal import GLOBAL, ConformalTable
    from predictor.service import Prediction

    model = MeanPredictor(40)
    model.conformal = ConformalTable(level=0.9, quantiles={GLOBAL: float(np.log(2.0))})  # upper ≈ 2·(p+1)−1
    svc = PredictorService(settings)
    svc._swap.current = (model, "vQ")
    got = asyncio.run(svc.predict_bounds(_item(), 500))
    assert got == Prediction(40, 81, "vQ")
    assert asyncio.run(svc.predict_bounds(_item(), 60)) == Prediction(40, 60, "vQ")  # clamped
    assert asyncio.run(svc.predict(_item(), 500)) == (40, "vQ")
    model.conformal = None
    assert asyncio.run(svc.predict_bounds(_item(), 500)) == Prediction(40, None, "vQ")


def test_predict_bounds_cold_start_plans_for_max_tokens(settings):
    svc = PredictorService(settings.model_copy(update={"cold_start": "64"}))
    svc.warmup()
    got = asyncio.run(svc.predict_bounds(_item(), 300))
    assert (got.tokens, got.upper, got.version) == (64, 300, None)
