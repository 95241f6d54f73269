import time

from fastapi import FastAPI
from fastapi.testclient import TestClient

from cohort.logdb import get_engine, record_request
from gateway.admin import make_admin_router
from predictor.baselines import MeanPredictor
from predictor.registry import Registry
from predictor.service import PredictorService

AUTH = {"Authorization": "Bearer s3cret"}


def _client(settings, reloaded):
    svc = PredictorService(settings, reload_interval_s=0.0)
    app = FastAPI()
    app.include_router(make_admin_router(settings, svc, estimator_reload_hook=lambda: reloaded.append(1)))
    return TestClient(app), svc


def test_auth(settings):
    client, _ = _client(settings, [])
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
        r = client.get("/admin/models", headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "authentication_error"
    assert client.post("/admin/retrain", json={"target": "predictor"}).status_code == 401
    assert client.post("/admin/models/v1/activate").status_code == 401
    assert client.get("/admin/models", headers=AUTH).status_code == 200


def test_models_activate_rollback(settings):
    reloaded = []
    client, svc = _client(settings, reloaded)
    reg = Registry(settings.data_dir, "predictor")
    src = settings.data_dir / "src"
    MeanPredictor(11).save(src / "a")
    MeanPredictor(22).save(src / "b")
    v1 = reg.register_dir(src / "a")
    v2 = reg.register_dir(src / "b")
    body = client.get("/admin/models", headers=AUTH).json()
    assert body["predictor"]["active"] == v2
    assert [v["version"] for v in body["predictor"]["versions"]] == [v1, v2]
    assert body["estimator"]["versions"] == []
    r = client.post(f"/admin/models/{v1}/activate", headers=AUTH)
    assert r.status_code == 200 and r.json() == {"target": "predictor", "active": v1}
    assert reg.active() == v1 and svc.version == v1  # the service swapped right away
    r = client.post("/admin/models/v-unknown/activate", headers=AUTH)
    assert r.status_code == 404 and r.json()["error"]["code"] == "version_not_found"


def test_retrain_endpoint(settings):
    reloaded = []
    client, svc = _client(settings.model_copy(update={"predictor_kind": "linear"}), reloaded)
    # no shared-data seeding in this test: an empty store file makes the log DB the only source
    from predictor.learning import predictor_store

    predictor_store(settings).touch()
    engine = get_engine(settings.database_url)
    t = time.time()
    for i in range(25):
        record_request(engine, {"id": f"r{i}", "created": t, "instruction": "I", "user_input": "x " * i,
                                "input_tokens": i + 1, "max_tokens": 256, "predicted_tokens": 1,
                                "actual_tokens": 3 * i + 40, "status": "done", "finished": t + i})
    r = client.post("/admin/retrain", headers=AUTH, json={"target": "predictor"})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["target"] == "predictor" and out["retrained"] and out["n_added"] == 25
    assert out["metrics"]["n"] >= 1 and svc.version == out["version"]
    assert client.post("/admin/retrain", headers=AUTH, json={"target": "bogus"}).status_code == 400
    r = client.post("/admin/retrain", headers=AUTH, json={"target": "estimator"})
    assert r.status_code == 200 and r.json()["retrained"] is False  # no samples yet: analytic stays
    assert reloaded == [1]
