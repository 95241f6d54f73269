"""Non-streaming answers come from the stream's end event; failures map through FailureCode."""

from __future__ import annotations

import asyncio

import pytest

from cohort.protocol import FailureCode, FinishReason, StreamEvent
from tests.gateway.harness import gateway, worker


def test_generate_answer_from_the_end_event(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["one", " two"], reason=FinishReason.LENGTH))
            r = await client.post("/v1/generate", json={"instruction": "Count.", "input": "go", "max_tokens": 2})
            return r, await w

    r, req = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    assert r.json() == {"id": req.id, "text": "one two", "generated_tokens": 2, "predicted_tokens": 2,
                        "finish_reason": "length", "batch": {"id": "b-1", "size": 3},
                        "timings": {"queued_s": 0.25, "first_token_s": 0.3, "run_s": 0.5, "total_s": 0.75}}
    assert req.instruction == "Count." and req.user_input == "go" and req.max_tokens == 2


def test_chat_and_completions_answer_whole(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["Hi", " there"]))
            chat = await client.post("/v1/chat/completions", json={
                "messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 5})
            await w
            w = asyncio.create_task(worker(redis, ["x"]))
            cmpl = await client.post("/v1/completions", json={"prompt": ["Hello"], "max_tokens": 5})
            return chat, cmpl, await w

    chat, cmpl, req = asyncio.run(scenario())
    assert chat.status_code == 200 and cmpl.status_code == 200
    c = chat.json()
    assert c["object"] == "chat.completion"
    assert c["choices"][0]["message"] == {"role": "assistant", "content": "Hi there"}
    assert c["choices"][0]["finish_reason"] == "stop" and c["usage"]["completion_tokens"] == 2
    k = cmpl.json()
    assert k["id"] == f"cmpl-{req.id}" and k["choices"][0]["text"] == "x"
    assert k["usage"] == {"prompt_tokens": req.input_tokens, "completion_tokens": 1,
                          "total_tokens": req.input_tokens + 1, "prompt_tokens_details": {"cached_tokens": 0}}


@pytest.mark.parametrize("code", [FailureCode.OUT_OF_MEMORY, FailureCode.WORKER_LOST, FailureCode.BATCH_FAILED])
def test_failure_maps_to_its_http_status(tmp_path, code):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["a"], final=StreamEvent.error(code, "it broke")))
            r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            await w
            return r

    r = asyncio.run(scenario())
    assert r.status_code == code.http_status
    assert r.json()["error"]["code"] == code.value and r.json()["error"]["message"] == "it broke"
