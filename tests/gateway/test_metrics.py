"""Token-latency histograms, queue time, end-to-end latency and request counts by endpoint."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from cohort import engine_counters
from tests.gateway.harness import end, gateway, sse_data, worker


def _samples(text: str) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


@pytest.mark.slow  # 0.37 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_stream_latencies_and_counts(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["a", "b", "c", "d"], gap_s=0.05))
            r = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True})
            await w
            bad = await client.post("/v1/chat/completions", json={"messages": []})
            return r, bad, (await client.get("/metrics")).text

    r, bad, text = asyncio.run(scenario())
    assert r.status_code == 200 and bad.status_code == 400
    m = _samples(text)
    chat = (("endpoint", "chat"),)
    assert m[("cohort_time_to_first_token_seconds_count", chat)] == 1
    assert m[("cohort_time_to_first_token_seconds_sum", chat)] >= 0.05
    assert m[("cohort_inter_token_latency_seconds_count", chat)] == 3       # 4 deltas, 3 gaps
    assert m[("cohort_inter_token_latency_seconds_sum", chat)] >= 3 * 0.04
    assert m[("cohort_request_queue_time_seconds_sum", chat)] == 0.25        # the end event's timings
    assert m[("cohort_e2e_request_latency_seconds_count", chat)] == 1
    assert m[("cohort_e2e_request_latency_seconds_sum", chat)] >= m[("cohort_time_to_first_token_seconds_sum", chat)]
    assert m[("cohort_generated_tokens_total", ())] == 4
    assert m[("cohort_requests_total", (("endpoint", "chat"), ("status", "200")))] == 1
    assert m[("cohort_requests_total", (("endpoint", "chat"), ("status", "400")))] == 1


def test_per_request_series_count_a_request_once_and_per_choice_series_each_choice(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            workers = [asyncio.create_task(worker(redis, ["a", "b"])) for _ in range(2)]
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                                  "n": 2})
            await asyncio.gather(*workers)
            return r, (await client.get("/metrics")).text

    r, text = asyncio.run(scenario())
    assert r.status_code == 200 and len(r.json()["choices"]) == 2
    m = _samples(text)
    chat = (("endpoint", "chat"),)
    for per_request in ("cohort_e2e_request_latency_seconds", "cohort_time_to_first_token_seconds",
                        "cohort_request_queue_time_seconds"):
        assert m[(f"{per_request}_count", chat)] == 1, per_request
    for per_choice in ("cohort_choice_e2e_latency_seconds", "cohort_choice_time_to_first_token_seconds"):
        assert m[(f"{per_choice}_count", chat)] == 2, per_choice


def test_prefix_cache_counters_and_cached_tokens_in_usage(tmp_path):
    """Instances count prefix-cache lookups in Redis (``engine_counters.count_prefix_cache``); the gateway exports
    them per instance, and a request's answer carries the prompt tokens the cache served."""
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            pipe = redis.pipeline()
            engine_counters.count_prefix_cache(pipe, "i0", 300, 192)
            engine_counters.count_prefix_cache(pipe, "i0", 20, 0)
            engine_counters.count_prefix_cache(pipe, "i1", 50, 16)
            await pipe.execute()
            w = asyncio.create_task(worker(redis, ["a", "b"], final=replace(end("ab", 2), cached_tokens=32)))
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
            await w
            w = asyncio.create_task(worker(redis, ["a"], final=replace(end("a", 1), cached_tokens=16)))
            s = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "hi"}], "stream": True,
                "stream_options": {"include_usage": True}})
            await w
            return r.json(), s.text, (await client.get("/metrics")).text

    body, streamed, text = asyncio.run(scenario())
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    usage = [d["usage"] for d in sse_data(streamed) if isinstance(d, dict) and d.get("usage")]
    assert usage == [{"prompt_tokens": usage[0]["prompt_tokens"], "completion_tokens": 1,
                      "total_tokens": usage[0]["prompt_tokens"] + 1, "prompt_tokens_details": {"cached_tokens": 16}}]
    m = _samples(text)
    assert m[("cohort_prefix_cache_queries_total", (("instance", "i0"),))] == 320
    assert m[("cohort_prefix_cache_hits_total", (("instance", "i0"),))] == 192
    assert m[("cohort_prefix_cache_hits_total", (("instance", "i1"),))] == 16
