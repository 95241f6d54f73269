"""The live runner keeps each request's answer and the server's eviction counters, so runs of one
workload under recompute, swap and adaptive preemption can be checked for identical greedy text."""

from __future__ import annotations

import asyncio

import httpx
from fastapi import FastAPI
from fastapi.responses import PlainTextResponse

from bench.live import answer_digests, compare_answers, run_live
from bench.roofline import instance
from bench.workload import WorkloadConfig, make_workload


def echo_gateway(counters: dict[str, int]) -> FastAPI:
    """Answers each request with its own instruction; counts one preemption and one swap per
    answer on /metrics (as ``cohort_batcher_events``)."""
    app = FastAPI()

    @app.post("/v1/generate")
    async def generate(body: dict):
        counters["preemptions"] += 2
        counters["swaps"] += 1
        return {"id": "x", "text": body["instruction"], "generated_tokens": body["emulated_tokens"],
                "predicted_tokens": 1, "batch": {"id": "b", "size": 1}, "timings": {"queued_s": 0.0}}

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse("".join(f'cohort_batcher_events{{event="{k}"}} {v}.0\n' for k, v in counters.items()))

    return app


def test_answers_and_eviction_counts_come_back(tiny_files, tiny_rows):
    wl = make_workload(WorkloadConfig(files=tiny_files, requests=12, rate=500.0, seed=3, max_tokens=32),
                       instance().time_model(), tiny_rows)
    counters = {"preemptions": 5, "swaps": 1}
    res = asyncio.run(run_live(wl, "http://testserver", transport=httpx.ASGITransport(app=echo_gateway(counters)),
                               time_limit_s=30.0))
    assert res.texts == [wl.rows.records[int(r)].instruction for r in wl.row]
    assert res.events == {"oom_splits": 0, "preemptions": 24, "swaps": 12}  # the run's own, not the counters' start


def test_answers_compare_by_request_across_runs():
    a = answer_digests(["x", "y", None, "z"])
    assert a[0] == answer_digests(["x"])[0] and a[2] is None and len(a[0]) == 16
    res = compare_answers({"recompute": a, "swap": answer_digests(["x", "y", "q", "z"]),
                           "adaptive": answer_digests(["x", "Y", "q", "z"])})
    assert res["compared"] == 3 and res["identical"] == 2 and res["differ"] == [1]  # request 2: one run failed
