"""The /admin router with a recording task queue: one bearer check for every route, retraining
is enqueued (never run in the gateway), versions list and activate (rollback)."""

from fastapi import FastAPI
from fastapi.testclient import TestClient

from gateway.admin import make_admin_router
from gateway.errors import install_error_handlers
from predictor.baselines import MeanPredictor
from predictor.registry import Registry
from predictor.service import PredictorService

AUTH = {"Authorization": "Bearer s3cret"}


class Tasks:
    """Stands in for the Celery learning queue: records what was sent, reports a state."""

    def __init__(self) -> None:
        self.sent: list[str] = []

    def enqueue(self, target: str) -> str:
        self.sent.append(target)
        return f"task-{len(self.sent)}"

    def status(self, task_id: str) -> dict:
        return {"state": "SUCCESS", "result": {"version": "v9"}} if task_id == "task-1" else {"state": "PENDING"}


def _client(settings, tasks=None):
    svc = PredictorService(settings, reload_interval_s=0.0)
    tasks = tasks or Tasks()
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(make_admin_router(settings.model_copy(update={"admin_token": "s3cret"}), svc,
                                         tasks.enqueue, tasks.status))
    return TestClient(app), svc


def test_every_route_needs_the_token(settings):
    client, _ = _client(settings)
    for method, path in (("get", "/admin/models"), ("post", "/admin/retrain"), ("get", "/admin/tasks/x"),
                         ("post", "/admin/models/v1/activate"), ("get", "/admin/queue"), ("get", "/admin/policy")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.request(method, path, headers=headers, json={"target": "predictor"})
            assert r.status_code == 401, (method, path, headers)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "authentication_error"
    assert client.get("/admin/models", headers=AUTH).status_code == 200


def test_models_activate_rollback(settings):
    client, svc = _client(settings)
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


def test_retrain_is_enqueued_and_its_state_reported(settings):
    tasks = Tasks()
    client, _ = _client(settings, tasks)
    r = client.post("/admin/retrain", headers=AUTH, json={"target": "predictor"})
    assert r.status_code == 202 and r.json() == {"target": "predictor", "task_id": "task-1", "status": "queued"}
    assert client.post("/admin/retrain", headers=AUTH, json={"target": "estimator"}).status_code == 202
    assert tasks.sent == ["predictor", "estimator"]
    bad = client.post("/admin/retrain", headers=AUTH, json={"target": "bogus"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "target" and tasks.sent[-1] == "estimator"
    assert client.get("/admin/tasks/task-1", headers=AUTH).json() == {
        "task_id": "task-1", "state": "SUCCESS", "result": {"version": "v9"}}
    assert client.get("/admin/tasks/task-2", headers=AUTH).json()["state"] == "PENDING"


def test_a_token_with_non_ascii_bytes_is_a_401_not_a_500(settings):
    client, _ = _client(settings)
    for raw in (b"Bearer s3cr\xe9t", b"Bearer \xff\xfe", "Bearer s3cret\u00e9".encode("latin-1")):
        r = client.get("/admin/models", headers=[(b"authorization", raw)])
        assert r.status_code == 401, raw


def test_the_public_document_hides_the_admin_routes(settings):
    from gateway import openapi as openapi_doc

    client, _ = _client(settings)
    openapi_doc.install(client.app)
    public = client.get("/openapi.json").json()["paths"]
    assert not any(p.startswith("/admin") for p in public)
    assert client.get("/admin/openapi.json").status_code == 401
    full = client.get("/admin/openapi.json", headers=AUTH).json()["paths"]
    assert "/admin/retrain" in full and "/admin/openapi.json" not in full
