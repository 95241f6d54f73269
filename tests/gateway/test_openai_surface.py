"""The OpenAI surface real clients use: /v1/models, routing by model to its pool, chat
templates, n choices, prompt lists and token-id prompts, echo, logprobs, and refusals that name
the field (README's parameter table). fakeredis and a fake worker stand in for the rest."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from cohort import bus
from cohort.settings import DEFAULT_MODEL
from cohort.tokenizer import prompt_token_ids, tokenizer_path
from tests.gateway.harness import MSG, gateway, next_request, post_alone, register, sse_data, worker

TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def templated(tmp_path_factory) -> str:
    """A tokenizer directory with a chat template (the built-in vocabulary, an instruct-style template)."""
    path = tmp_path_factory.mktemp("templated")
    tok = AutoTokenizer.from_pretrained(tokenizer_path(DEFAULT_MODEL))
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    return str(path)


def test_models_lists_every_pool_and_unknown_models_are_404(tmp_path):
    async def scenario():
        async with gateway(tmp_path, served_model_name="tiny-a") as (_, client, redis):
            await register(redis, "b0", "pool-b", DEFAULT_MODEL, served="org/tiny-b", theta=1000 * 2048)
            listed = await client.get("/v1/models")
            one = await client.get("/v1/models/org/tiny-b")
            by_pool = await client.get("/v1/models/pool-b")
            missing = await client.get("/v1/models/gpt-4o")
            bad_chat = await client.post("/v1/chat/completions", json={"model": "gpt-4o", "messages": MSG})
            empty = await client.post("/v1/completions", json={"model": "", "prompt": "x"})
            return listed, one, by_pool, missing, bad_chat, empty, await redis.llen(bus.pool_keys("default").incoming)

    listed, one, by_pool, missing, bad_chat, empty, queued = asyncio.run(scenario())
    data = listed.json()["data"]
    assert listed.json()["object"] == "list" and [m["id"] for m in data] == ["tiny-a", "org/tiny-b"]
    assert {m["object"] for m in data} == {"model"} and all(m["owned_by"] == "cohort" for m in data)
    assert data[0]["max_model_len"] == 4096 and data[1]["max_model_len"] == 1000  # pool-b's KV holds 1000 tokens
    assert one.json()["id"] == "org/tiny-b" and one.json()["pool"] == "pool-b" and by_pool.json() == one.json()
    for r in (missing, bad_chat, empty):
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert r.json()["error"]["param"] == "model" and r.json()["error"]["type"] == "not_found_error"
    assert queued == 0


@pytest.mark.slow  # 0.40 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_model_routes_to_its_pool_and_withdrawals_go_there(tmp_path):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.3) as (_, client, redis):
            await register(redis, "b0", "pool-b", DEFAULT_MODEL, served="tiny-b")
            w = asyncio.create_task(worker(redis, ["ok"], pool="pool-b"))
            r = await client.post("/v1/completions", json={"model": "tiny-b", "prompt": "hi", "max_tokens": 2})
            req = await w
            timed_out = await client.post("/v1/completions", json={"model": "tiny-b", "prompt": "x", "max_tokens": 2})
            lost = await next_request(redis, pool="pool-b")
            cancels = await redis.lrange(bus.pool_keys("pool-b").cancels, 0, -1)
            await register(redis, "c0", "pool-c", DEFAULT_MODEL, served="tiny-c", alive=False)
            dead = await client.post("/v1/completions", json={"model": "tiny-c", "prompt": "x"})
            default = await redis.llen(bus.pool_keys("default").incoming)
            return r, req, timed_out, lost, cancels, dead, default

    r, req, timed_out, lost, cancels, dead, default = asyncio.run(scenario())
    assert r.status_code == 200 and r.json()["model"] == "tiny-b" and r.json()["choices"][0]["text"] == "ok"
    assert req.model == DEFAULT_MODEL
    assert timed_out.status_code == 504 and cancels == [lost.id]
    assert dead.status_code == 503 and dead.json()["error"]["code"] == "no_instance"
    assert default == 0


@pytest.mark.parametrize("extra,param", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"audio": {"voice": "alloy"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs: true
    ({"n": 17}, "n"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "42"}]}, "messages.1"),
])
def test_unsupported_chat_fields_are_a_400_naming_them(tmp_path, extra, param):
    _, r, queued = post_alone(tmp_path, "/v1/chat/completions", {"messages": MSG, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert queued == 0


@pytest.mark.parametrize("extra,param", [
    ({"suffix": "end"}, "suffix"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 1, "stream": True}, "stream"),  # the prompt's logprobs are not streamed
    ({"prompt_logprobs": 1, "stream": True}, "stream"),
    ({"max_tokens": 0}, "max_tokens"),  # only with echo
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"logprobs": 6}, "logprobs"),
    ({"prompt": [1, 2, 99999999]}, "prompt"),
    ({"prompt": []}, "prompt"),
])
def test_unsupported_completion_fields_are_a_400_naming_them(tmp_path, extra, param):
    async def scenario():
        async with gateway(tmp_path) as (_, client, _redis):
            return await client.post("/v1/completions", json={"prompt": "x", **extra})

    r = asyncio.run(scenario())
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_neutral_values_of_unsupported_fields_are_accepted(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["ok"]))
            r = await client.post("/v1/chat/completions", json={
                "messages": MSG, "tools": [], "tool_choice": "none", "response_format": {"type": "text"},
                "modalities": ["text"], "store": False, "user": "u1", "metadata": {"k": "v"}, "vendor_extra": 1})
            await w
            return r

    r = asyncio.run(scenario())
    assert r.status_code == 200, r.text


def test_n_copies_are_admitted_together_and_answered_as_choices(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            post = asyncio.create_task(client.post("/v1/chat/completions", json={
                "messages": MSG, "n": 3, "temperature": 0.8, "seed": 10, "max_tokens": 4}))
            while await redis.llen(bus.pool_keys("default").incoming) < 3:  # one push: all three at once
                await asyncio.sleep(0.01)
            reqs = [await worker(redis, [f"answer {k}"]) for k in range(3)]
            return await post, reqs

    r, reqs = asyncio.run(scenario())
    body = r.json()
    assert r.status_code == 200 and [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["answer 0", "answer 1", "answer 2"]
    assert [q.sampling.seed for q in reqs] == [10, 11, 12] and len({q.id for q in reqs}) == 3
    assert body["usage"]["prompt_tokens"] == reqs[0].input_tokens  # the prompt counts once
    assert body["usage"]["completion_tokens"] == 3


def test_n_streams_with_an_index_per_choice(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            post = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": "Once", "n": 2, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}))
            a = await worker(redis, ["a1", "a2"])
            b = await worker(redis, ["b1"])
            return await post, a, b

    r, a, b = asyncio.run(scenario())
    chunks = sse_data(r.text)[:-1]
    by_index: dict[int, list[str]] = {0: [], 1: []}
    finish = {}
    for c in chunks[:-1]:
        (choice,) = c["choices"]
        by_index[choice["index"]].append(choice["text"])
        if choice["finish_reason"]:
            finish[choice["index"]] = choice["finish_reason"]
    assert "".join(by_index[0]) == "a1a2" and "".join(by_index[1]) == "b1" and finish == {0: "stop", 1: "stop"}
    assert chunks[-1]["usage"]["completion_tokens"] == 3 and chunks[-1]["usage"]["prompt_tokens"] == a.input_tokens


def test_prompt_lists_token_prompts_and_echo(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            post = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": [[2023, 2003], [7592, 2088, 999]], "max_tokens": 3, "echo": True}))
            reqs = [await worker(redis, [" x"]) for _ in range(2)]
            texts = asyncio.create_task(client.post("/v1/completions", json={"prompt": ["one", "two"], "n": 2}))
            more = [await worker(redis, [f"-{k}"]) for k in range(4)]
            return await post, reqs, await texts, more

    r, reqs, texts, more = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    assert [q.prompt_ids for q in reqs] == [[2023, 2003], [7592, 2088, 999]]
    assert [q.input_tokens for q in reqs] == [2, 3] and r.json()["usage"]["prompt_tokens"] == 5
    assert [c["text"] for c in r.json()["choices"]] == [reqs[0].prompt + " x", reqs[1].prompt + " x"]
    assert reqs[0].prompt == "this is"  # the token ids' text, for the predictor and the log DB
    assert [q.user_input for q in more] == ["one", "one", "two", "two"]  # index = prompt · n + copy
    assert [c["index"] for c in texts.json()["choices"]] == [0, 1, 2, 3]


LP = [[-0.25, [[101, -0.25], [7, -1.5]]], [-0.5, [[102, -0.5], [8, -1.0]]]]


def test_logprobs_in_both_shapes(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["Hel", "lo"], logprobs=LP))
            chat = await client.post("/v1/chat/completions", json={"messages": MSG, "logprobs": True,
                                                                   "top_logprobs": 2})
            chat_req = await w
            w = asyncio.create_task(worker(redis, ["Hel", "lo"], logprobs=LP))
            comp = await client.post("/v1/completions", json={"prompt": "x", "logprobs": 2})
            comp_req = await w
            w = asyncio.create_task(worker(redis, ["Hel", "lo"], logprobs=LP))
            stream = await client.post("/v1/chat/completions", json={"messages": MSG, "logprobs": True,
                                                                     "stream": True})
            await w
            return chat, chat_req, comp, comp_req, stream

    chat, chat_req, comp, comp_req, stream = asyncio.run(scenario())
    assert chat_req.sampling.logprobs == 2 and comp_req.sampling.logprobs == 2
    content = chat.json()["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == [-0.25, -0.5]
    assert [[t["logprob"] for t in c["top_logprobs"]] for c in content] == [[-0.25, -1.5], [-0.5, -1.0]]
    assert all(c["bytes"] == list(c["token"].encode()) for c in content)
    lp = comp.json()["choices"][0]["logprobs"]
    assert lp["token_logprobs"] == [-0.25, -0.5] and len(lp["tokens"]) == 2
    assert lp["text_offset"] == [0, len(lp["tokens"][0])]
    assert all(len(top) >= 2 for top in lp["top_logprobs"])
    chunks = [c for c in sse_data(stream.text)[:-1] if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert [c["choices"][0]["logprobs"]["content"][0]["logprob"] for c in chunks] == [-0.25, -0.5]


def test_chat_uses_the_served_tokenizers_template(tmp_path: Path, templated: str):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            await register(redis, "t0", "instruct", templated, served="instruct-model")
            w = asyncio.create_task(worker(redis, ["ok"], pool="instruct"))
            r = await client.post("/v1/chat/completions", json={"model": "instruct-model", "messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]})
            templated_req = await w
            w = asyncio.create_task(worker(redis, ["ok"]))
            await client.post("/v1/chat/completions", json={"messages": [
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]})
            return r, templated_req, await w

    r, req, builtin = asyncio.run(scenario())
    assert r.status_code == 200, r.text
    assert req.prompt == "<|system|>Be brief.\n<|user|>Hello\n<|assistant|>"
    tok = AutoTokenizer.from_pretrained(templated)
    assert req.prompt_ids == tok(req.prompt, add_special_tokens=False)["input_ids"]
    assert req.input_tokens == len(req.prompt_ids)
    assert (req.instruction, req.user_input) == ("Be brief.", "user: Hello")  # what the predictor reads
    assert builtin.prompt == "Be brief.\n\nuser: Hello\nassistant:"
    assert builtin.prompt_ids == prompt_token_ids([builtin.prompt])[0]  # tokenized once, here: the worker runs these
    assert json.loads(json.dumps(req.to_dict()))["prompt_ids"] == req.prompt_ids
