"""Live runner against a tiny in-process fake of the gateway (no Redis, no model)."""

from __future__ import annotations

import asyncio
import itertools

import httpx
import pytest
from fastapi import FastAPI

from bench.live import check_loopback, run_live
from bench.live_stack import run_env
from bench.roofline import instance
from bench.workload import WorkloadConfig, make_workload


def fake_gateway(tick_s: float = 0.02, per_token_s: float = 0.0005, fail_every: int = 0) -> FastAPI:
    """Collects requests for ``tick_s``, runs them as one batch for G(B)·per_token_s, answers all."""
    app = FastAPI()
    waiting: list[tuple[dict, asyncio.Future]] = []
    ids = itertools.count()
    state = {"runner": None}

    async def runner():
        while True:
            await asyncio.sleep(tick_s)
            if not waiting:
                continue
            batch = list(waiting)
            waiting.clear()
            bid = f"b-{next(ids)}"
            g_b = max(body["emulated_tokens"] for body, _ in batch)
            await asyncio.sleep(g_b * per_token_s)
            for body, fut in batch:
                fut.set_result({"id": "x", "text": "", "generated_tokens": body["emulated_tokens"],
                                "predicted_tokens": body["emulated_tokens"], "batch": {"id": bid, "size": len(batch)},
                                "timings": {"queued_s": 0.0, "run_s": 0.0, "total_s": 0.0}})

    seen = itertools.count(1)

    @app.post("/v1/generate")
    async def generate(body: dict):
        if state["runner"] is None:
            state["runner"] = asyncio.create_task(runner())
        if fail_every and next(seen) % fail_every == 0:
            from fastapi.responses import JSONResponse

            return JSONResponse({"error": {"message": "overloaded", "type": "overloaded", "code": 429}}, 429)
        assert body["emulated_tokens"] <= body["max_tokens"] and body["slo_seconds"] > 0
        fut = asyncio.get_running_loop().create_future()
        waiting.append((body, fut))
        return await fut

    return app


@pytest.fixture
def workload(tiny_files, tiny_rows):
    cfg = WorkloadConfig(files=tiny_files, requests=60, rate=200.0, seed=5, max_tokens=64)
    return make_workload(cfg, instance().time_model(), tiny_rows)


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_live_runner_collects_the_metrics(workload):
    app = fake_gateway()
    res = asyncio.run(run_live(workload, "http://testserver", transport=httpx.ASGITransport(app=app),
                               time_limit_s=30.0))
    m = res.metrics
    assert m["completed"] == 60 and m["failed"] == 0 and res.errors == {}
    assert m["mean_batch_size"] > 1.0 and res.batches < 60
    assert m["request_throughput"] > 0 and m["mean_latency_s"] > 0
    assert m["valid_token_throughput"] <= m["total_token_throughput"] + 1e-9


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_errors_and_the_time_limit_count_as_failures(workload):
    app = fake_gateway(fail_every=3)
    res = asyncio.run(run_live(workload, "http://testserver", transport=httpx.ASGITransport(app=app),
                               time_limit_s=30.0))
    assert res.errors == {"http_429": 20}
    assert res.metrics["completed"] == 40 and res.metrics["failed"] == 20
    slow = fake_gateway(per_token_s=0.05)   # a batch of 64 tokens takes 3.2 s
    res = asyncio.run(run_live(workload, "http://testserver", transport=httpx.ASGITransport(app=slow),
                               time_limit_s=0.3))
    assert res.errors.get("time_limit", 0) > 0
    assert res.metrics["completed"] + res.metrics["failed"] == 60
    assert res.wall_s < 5.0


def test_only_loopback_urls():
    for ok in ("http://127.0.0.1:8000", "http://localhost:1", "http://[::1]:8000"):
        check_loopback(ok)
    with pytest.raises(ValueError):
        check_loopback("http://example.com:8000")


def test_a_live_run_name_picks_the_servers_execution_mode():
    assert run_env("magnus") == {"COHORT_POLICY": "magnus"}
    assert run_env("magnus@static") == {"COHORT_POLICY": "magnus", "COHORT_EXECUTION": "static",
                                        "COHORT_OOM_RECOVERY": "split"}
    assert run_env("s3-hrrn@elastic/split")["COHORT_OOM_RECOVERY"] == "split"
    with pytest.raises(ValueError, match="oracle"):
        run_env("magnus+oracle@elastic")
