"""gateway → predictor → batcher → Redis → Celery worker → model → response, all real processes."""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import time

import httpx
import pytest

from batcher.wma import total_wma

pytestmark = pytest.mark.e2e
# Φ between the WMA of a long-only batch (~6.3k token reads) and a short+long one (~10k). The batches'
# padding is the test's subject, so it runs the padded elastic path: under continuous execution a
# batch is sent as soon as the last one joins the running rows (every step or so), forms in arrival
# order and pads nothing (its e2e tests: test_continuous.py; the rest of the suite runs it by default).
STACK_ENV = {"COHORT_POLICY": "magnus", "COHORT_WMA_THRESHOLD": "8000", "COHORT_EXECUTION": "elastic"}

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly box jugglers".split()


def workload(n: int, seed: int = 7) -> list[dict]:
    """Mixed short/long inputs and generation lengths, shuffled so FCFS mixes them."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        short = i % 2 == 0
        words = rng.randint(3, 8) if short else rng.randint(40, 70)
        gen = rng.choice([2, 4, 6, 8]) if short else rng.choice([48, 64, 80])
        out.append({"instruction": "Summarize the text." if short else "Translate the text to German.",
                    "input": " ".join(rng.choice(WORDS) for _ in range(words)),
                    "max_tokens": gen + 4, "emulated_tokens": gen})
    rng.shuffle(out)
    return out


async def _fire(url: str, bodies: list[dict], stagger_s: float = 0.01) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def one(i: int, b: dict) -> httpx.Response:
            await asyncio.sleep(i * stagger_s)
            return await c.post("/v1/generate", json=b)
        return await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))


def test_concurrent_requests_answered_with_exact_lengths_in_homogeneous_batches(stack):
    bodies = workload(32)
    responses = asyncio.run(_fire(stack.url, bodies))
    assert [r.status_code for r in responses] == [200] * len(bodies), [r.text for r in responses if r.status_code != 200]
    got = [r.json() for r in responses]
    for body, res in zip(bodies, got, strict=True):
        assert res["generated_tokens"] == body["emulated_tokens"]
        assert res["predicted_tokens"] >= 1 and res["batch"]["size"] >= 1
        assert res["timings"]["total_s"] >= res["timings"]["run_s"] > 0
    batch_ids = {g["batch"]["id"] for g in got}
    assert len(batch_ids) < len(bodies), "requests were batched together"

    # Compare with FCFS on the same arrivals: same batch sizes in dispatch order, members in arrival order.
    con = sqlite3.connect(stack.db_path)
    ids = [g["id"] for g in got]
    deadline = time.time() + 30  # the worker logs right after answering: on a busy CPU, a moment later
    while True:
        rows = con.execute(f"SELECT id, created, input_tokens, actual_tokens, batch_id FROM requests WHERE id IN "
                           f"({','.join('?' * len(ids))}) ORDER BY created", ids).fetchall()
        if time.time() > deadline or (len(rows) == len(bodies) and all(r[3] is not None for r in rows)):
            break
        time.sleep(0.1)
    assert len(rows) == len(bodies) and all(r[3] is not None for r in rows)
    by_batch: dict[str, list[tuple[int, int]]] = {}
    for _, _, L, G, bid in rows:
        by_batch.setdefault(bid, []).append((L, G))
    marks = ",".join("?" * len(by_batch))
    order = [b for (b,) in con.execute(f"SELECT id FROM batches WHERE id IN ({marks}) ORDER BY started",
                                       list(by_batch))]
    ours = sum(total_wma(by_batch[b]) for b in order)
    arrivals = [(L, G) for _, _, L, G, _ in rows]
    fcfs, i = 0, 0
    for b in order:
        n = len(by_batch[b])
        fcfs += total_wma(arrivals[i:i + n])
        i += n
    print(f"batches={len(order)} sizes={[len(by_batch[b]) for b in order]} WMA ours={ours} fcfs={fcfs}")
    assert ours < fcfs


def test_openai_completions_chat_and_stream(stack):
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        r = c.post("/v1/completions", json={"model": "default", "prompt": "Hello there", "max_tokens": 5,
                                             "ignore_eos": True, "logit_bias": {}, "user": "u1"})
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["object"] == "text_completion" and j["usage"]["completion_tokens"] == 5
        assert j["usage"]["total_tokens"] == j["usage"]["prompt_tokens"] + 5
        assert j["choices"][0]["finish_reason"] == "length"
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "system", "content": "Be brief."},
                                                              {"role": "user", "content": "Hi"}],
                                                 "max_tokens": 3, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
        assert r.json()["usage"]["completion_tokens"] == 3
        r = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True, "ignore_eos": True,
                                             "stream_options": {"include_usage": True}})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [e.removeprefix("data: ") for e in r.text.strip().split("\n\n")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 2
        assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize("body,param", [
    ({"input": "x", "max_tokens": 0}, "max_tokens"),
    ({"input": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"max_tokens": 5}, "input"),
    ({"input": "x", "slo_seconds": -1}, "slo_seconds"),
    ({"input": "x", "max_tokens": 4, "emulated_tokens": 9}, "emulated_tokens"),
    ({"input": "x", "max_tokens": "lots"}, "max_tokens"),
])
def test_bad_input_is_a_clear_400(stack, body, param):
    r = httpx.post(f"{stack.url}/v1/generate", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]


def test_hostile_inputs_never_reach_the_model(stack):
    """What once failed a batch with a 500 and raw exception text is refused at the gateway (or,
    for a tiny temperature, sampled greedily); every error carries the request id."""
    chat = "/v1/chat/completions"
    cases = [("/v1/generate", {"input": " ", "max_tokens": 4}, 400),
             ("/v1/generate", {"input": "\u200b", "max_tokens": 4}, 400),
             ("/v1/generate", {"input": "hello", "max_tokens": 4, "seed": 2**70}, 400),
             ("/v1/completions", {"prompt": "x" * 3_000_000, "max_tokens": 4}, 413),
             (chat, {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4}, 400),
             ("/v1/generate", {"input": "hello", "max_tokens": 4, "temperature": 1e-40, "priority": -1}, 200),
             (chat, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "seed": 2**63 - 1,
                     "temperature": 0.9}, 200)]
    with httpx.Client(base_url=stack.url, timeout=120) as c:
        for path, body, status in cases:
            r = c.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
            assert r.status_code == status, (path, str(body)[:80], r.text[:300])
            if status != 200:
                assert r.json()["error"]["request_id"] == r.headers["x-request-id"]


def test_malformed_json_and_unknown_route(stack):
    r = httpx.post(f"{stack.url}/v1/generate", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.get(f"{stack.url}/nope").json()["error"]["type"] == "not_found_error"


def test_admin_routes_are_not_mounted_without_a_token(stack):
    assert httpx.get(f"{stack.url}/admin/models").status_code == 404


def test_metrics_expose_queue_and_batches(stack):
    r = httpx.post(f"{stack.url}/v1/generate", json={"input": "count me", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    text = httpx.get(f"{stack.url}/metrics").text
    assert 'cohort_requests_total{endpoint="generate",status="200"}' in text
    assert 'cohort_e2e_request_latency_seconds_count{endpoint="generate"}' in text
    assert 'cohort_batcher_events{event="batches_dispatched"}' in text
    assert "cohort_instances_alive 1.0" in text


def test_worker_killed_mid_batch_requests_still_answered(stack):
    """SIGKILL the worker while it runs a batch; a new worker comes up; nothing is lost."""
    bodies = [{"input": f"long job {i}", "max_tokens": 300, "emulated_tokens": 300} for i in range(3)]

    async def scenario() -> list[httpx.Response]:
        task = asyncio.create_task(_fire(stack.url, bodies, stagger_s=0.0))
        deadline = time.time() + 30
        while time.time() < deadline:  # wait until the worker has claimed a batch
            if any(k for k in stack.redis.scan_iter("cohort:batch:*:claim")
                   if not stack.redis.exists(k.replace(":claim", ":done"))):
                break
            await asyncio.sleep(0.05)
        stack.kill("worker")
        stack.spawn("worker2", "worker")
        return await task

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200, 200, 200], [r.text for r in responses]
    assert [r.json()["generated_tokens"] for r in responses] == [300, 300, 300]
    assert int(stack.redis.hget("cohort:stats", "requeues") or 0) >= 1
