"""Admin endpoints and continuous learning on the real stack: requests are logged, retraining
on demand learns from them, the gateway swaps the new predictor in, rollback works."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

pytestmark = pytest.mark.e2e
TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
STACK_ENV = {"COHORT_ADMIN_TOKEN": TOKEN, "COHORT_LEARNING__SEED_ROWS_PER_TASK": "0"}
STACK_LEARNING = True  # /admin/retrain enqueues; the learning worker runs it


def _retrain(url: str, target: str) -> dict:
    """Enqueue a retraining and wait for the learning worker to finish it."""
    r = httpx.post(f"{url}/admin/retrain", headers=AUTH, json={"target": target})
    assert r.status_code == 202, r.text
    task_id = r.json()["task_id"]
    deadline = time.time() + 600
    while time.time() < deadline:
        st = httpx.get(f"{url}/admin/tasks/{task_id}", headers=AUTH).json()
        if st["state"] in ("SUCCESS", "FAILURE"):
            assert st["state"] == "SUCCESS", st
            return st["result"]
        time.sleep(0.5)
    raise TimeoutError(f"retraining {target} did not finish")


def _bodies(n: int) -> list[dict]:
    out = []
    for i in range(n):
        if i % 2:
            out.append({"instruction": "Answer yes or no.", "input": f"Is {i} even?", "max_tokens": 64,
                        "emulated_tokens": 3})
        else:
            out.append({"instruction": "Write a detailed essay.", "input": f"Topic number {i}: the sea "
                        + "and the waves " * 6, "max_tokens": 64, "emulated_tokens": 40})
    return out


async def _fire(url: str, bodies: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        return await asyncio.gather(*(c.post("/v1/generate", json=b) for b in bodies))


@pytest.mark.parametrize("method,path", [("get", "/admin/models"), ("post", "/admin/retrain"),
                                         ("get", "/admin/policy"), ("get", "/admin/queue"),
                                         ("get", "/admin/tasks/x"),
                                         ("post", "/admin/models/x/activate")])
def test_admin_refuses_missing_or_wrong_token(stack, method, path):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
        r = httpx.request(method, f"{stack.url}{path}", headers=headers, json={"target": "predictor"})
        assert r.status_code == 401, (path, headers, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_policy_and_queue_state(stack):
    p = httpx.get(f"{stack.url}/admin/policy", headers=AUTH).json()
    assert p["policy"] == "magnus" and p["settings"]["wma_threshold"] > 0 and len(p["instances"]) == 1
    q = httpx.get(f"{stack.url}/admin/queue", headers=AUTH).json()
    assert {"incoming", "pending", "inflight", "stats"} <= set(q)


def test_retrain_on_demand_learns_from_logged_requests_and_rolls_back(stack):
    cold = asyncio.run(_fire(stack.url, _bodies(24)))
    assert all(r.status_code == 200 for r in cold), [r.text for r in cold]
    assert {r.json()["predicted_tokens"] for r in cold} == {64}  # cold start: max_tokens

    out = _retrain(stack.url, "predictor")
    v1 = out["version"]
    assert v1 and out["n_added"] == 24  # every cold-start prediction was off by >10 tokens and >10%
    models = httpx.get(f"{stack.url}/admin/models", headers=AUTH).json()
    assert models["predictor"]["active"] == v1
    for _ in range(120):  # the gateway's reload loop swaps the new version in within a second (30 s on a busy CPU)
        if httpx.get(f"{stack.url}/admin/models", headers=AUTH).json()["predictor"]["in_use"] == v1:
            break
        time.sleep(0.25)

    warm = asyncio.run(_fire(stack.url, _bodies(6)))
    preds = [(b["emulated_tokens"], r.json()["predicted_tokens"]) for b, r in zip(_bodies(6), warm, strict=True)]
    short = [p for t, p in preds if t == 3]
    long_ = [p for t, p in preds if t == 40]
    assert max(short) < 20 and min(long_) > 20, preds  # the swapped-in model tells them apart

    assert httpx.post(f"{stack.url}/admin/models/no-such-version/activate", headers=AUTH).status_code == 404
    assert "version" in _retrain(stack.url, "estimator")
    assert httpx.post(f"{stack.url}/admin/retrain", headers=AUTH, json={"target": "nonsense"}).status_code == 400
