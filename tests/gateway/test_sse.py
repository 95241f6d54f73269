"""OpenAI streaming: chunk sequence and shapes for chat and completions, usage, errors mid-stream,
re-run deltas not relayed twice."""

from __future__ import annotations

import asyncio

from cohort import bus
from cohort.protocol import FailureCode, FinishReason, StreamEvent
from tests.gateway.harness import end, gateway, next_request, publish, sse_data, worker

CHAT = {"model": "default", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "max_tokens": 8, "stream": True}
PIECES = ["Hel", "lo, ", "wörld", "!"]


def test_chat_stream_chunks_with_usage(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, PIECES))
            r = await client.post("/v1/chat/completions",
                                  json={**CHAT, "stream_options": {"include_usage": True}})
            return r, await w

    r, req = asyncio.run(scenario())
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert {c["id"] for c in chunks} == {f"chatcmpl-{req.id}"}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    first, deltas, finish, usage = chunks[0], chunks[1:-2], chunks[-2], chunks[-1]
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert first["choices"][0]["finish_reason"] is None
    assert [c["choices"][0]["delta"] for c in deltas] == [{"content": p} for p in PIECES]
    assert all(c["choices"][0]["finish_reason"] is None for c in deltas)
    assert finish["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert all(c["usage"] is None for c in chunks[:-1])  # OpenAI: null on every chunk but the last
    assert usage["choices"] == [] and usage["usage"] == {
        "prompt_tokens": req.input_tokens, "completion_tokens": 4, "total_tokens": req.input_tokens + 4,
        "prompt_tokens_details": {"cached_tokens": 0}}


def test_completions_stream_without_usage(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            # "" : a token whose character is not complete yet (the worker holds its bytes back)
            w = asyncio.create_task(worker(redis, ["a", "", "b", "c"], reason=FinishReason.LENGTH))
            r = await client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 4, "stream": True})
            return r, await w

    r, req = asyncio.run(scenario())
    events = sse_data(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "text_completion" and c["id"] == f"cmpl-{req.id}" for c in chunks)
    assert all("usage" not in c for c in chunks)
    assert [c["choices"][0]["text"] for c in chunks] == ["a", "b", "c", ""]  # no opening chunk
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]


def test_error_mid_stream_is_an_error_event_then_done(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (app, client, redis):
            oom = StreamEvent.error(FailureCode.OUT_OF_MEMORY, "a single request cannot fit")
            w = asyncio.create_task(worker(redis, ["x", "y"], final=oom))
            r = await client.post("/v1/chat/completions", json=CHAT)
            await w
            metrics = (await client.get("/metrics")).text
            return r, metrics

    r, metrics = asyncio.run(scenario())
    assert r.status_code == 200  # the headers were sent before the failure
    events = sse_data(r.text)
    assert [e["choices"][0]["delta"].get("content") for e in events[:3]] == ["", "x", "y"]
    assert events[3] == {"error": {"message": "a single request cannot fit", "type": "server_error",
                                   "param": None, "code": "out_of_memory"}}
    assert events[4:] == ["[DONE]"]
    assert 'cohort_request_failures_total{code="out_of_memory",endpoint="chat"} 1.0' in metrics


def test_rerun_deltas_are_not_relayed_twice(tmp_path):
    """A worker lost mid-run: the batch is re-run from the start and publishes tokens 1, 2 again."""
    async def rerun_worker(redis):
        req = await next_request(redis)
        for text, tokens in [("a", 1), ("b", 2), ("a", 1), ("b", 2), ("c", 3)]:
            await publish(redis, req.id, StreamEvent.delta(text, tokens))
        await publish(redis, req.id, end("abcd", 4))  # "d" never came as a delta: relayed from the end

    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(rerun_worker(redis))
            r = await client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True})
            await w
            return r, await redis.keys(bus.stream_key("*"))

    r, kept = asyncio.run(scenario())
    texts = [c["choices"][0]["text"] for c in sse_data(r.text)[:-1]]
    assert texts == ["a", "b", "c", "d", ""]
    assert len(kept) == 1  # read, not deleted: the batcher tells answered rows by their streams
