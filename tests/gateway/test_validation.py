"""Hostile input is refused at the gateway, before tokenizing or reaching a model: every case of
the chaos harness's BAD_BODIES gets its expected answer (a 4xx with an OpenAI-style body and a
request id; a tiny temperature is sampled greedily), and errors never carry raw exception text."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from sqlalchemy import func, select

from bench.chaos import BAD_BODIES
from cohort import bus
from cohort.logdb import requests
from tests.gateway.harness import MSG, answering, gateway, next_request, post_alone


def _rows(app) -> int:
    with app.state.db.connect() as conn:
        return conn.execute(select(func.count()).select_from(requests)).scalar_one()


def test_every_bad_body_gets_its_expected_answer(tmp_path):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=5) as (app, client, redis):
            out = []
            async with answering(redis):
                for path, body, expect in BAD_BODIES:
                    raw = body if isinstance(body, str) else json.dumps(body)
                    r = await client.post(path, content=raw.encode("utf-8", "surrogatepass"),
                                          headers={"content-type": "application/json"})
                    out.append((path, raw[:80], expect, r))
            return out

    for path, raw, expect, r in asyncio.run(scenario()):
        case = f"{path} {raw!r}: {r.status_code} {r.text[:200]}"
        if expect == "200":
            assert r.status_code == 200, case
            continue
        assert 400 <= r.status_code < 500, case
        err = r.json()["error"]
        assert err["message"] and err["type"] and err["request_id"] == r.headers["x-request-id"], case
        assert "Traceback" not in err["message"] and "Error(" not in err["message"], case


@pytest.mark.parametrize(("body", "param", "code"), [
    ({"input": " ", "max_tokens": 4}, "input", "empty_prompt"),
    ({"input": "\u200b\u200b", "max_tokens": 4}, "input", "empty_prompt"),
    ({"input": "hi", "seed": 2**63}, "seed", "invalid_value"),
    ({"input": "hi", "seed": -1}, "seed", "invalid_value"),
    ({"input": "hi", "top_p": 0}, "top_p", "invalid_value"),
    ({"input": "hi", "priority": 2**31}, "priority", "invalid_value"),
    ({"input": "x" * 1001}, "input", "text_too_long"),
    ({"instruction": "y" * 600, "input": "x" * 600}, "input", "text_too_long"),
    ({"input": "ok \ud800"}, "input", "invalid_text"),
])
def test_generate_refusals_name_the_field(tmp_path, body, param, code):
    app, r, _ = post_alone(tmp_path, "/v1/generate", body, max_text_chars=1000)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == (param, code), err
    assert _rows(app) == 0  # refused: no record


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
     "messages.0.content.0.text"),
    ("/v1/chat/completions", {"messages": MSG, "stop": ["\ud83d"]}, "stop.0"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "z" * 1001}]}, "messages.0.content"),
    ("/v1/completions", {"prompt": ["a" * 600, "b" * 600]}, "prompt"),
    ("/v1/completions", {"prompt": [5, 2**70]}, "prompt"),
])
def test_openai_refusals_name_the_field(tmp_path, path, body, param):
    _, r, _ = post_alone(tmp_path, path, body, max_text_chars=1000)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tiny_temperature_is_greedy_and_big_seeds_wrap(tmp_path):
    async def scenario():
        async with gateway(tmp_path, request_timeout_s=0.15) as (_, client, redis):
            t1 = asyncio.create_task(client.post("/v1/generate", json={"input": "hi", "temperature": 1e-40}))
            first = await next_request(redis)
            t2 = asyncio.create_task(client.post("/v1/completions", json={
                "prompt": "hi", "n": 2, "seed": 2**63 - 1, "temperature": 0.5}))
            copies = [await next_request(redis), await next_request(redis)]
            await asyncio.gather(t1, t2)
            return first, copies

    first, copies = asyncio.run(scenario())
    assert first.sampling.temperature == 0.0 and first.sampling.greedy
    assert sorted(c.sampling.seed for c in copies) == [0, 2**63 - 1]


def test_body_larger_than_any_valid_request_is_413(tmp_path):
    async def scenario():
        async with gateway(tmp_path, max_text_chars=10) as (_, client, _r):
            return await client.post("/v1/generate", content=b'{"input": "' + b"x" * (2 << 20) + b'"}',
                                     headers={"content-type": "application/json"})

    r = asyncio.run(scenario())
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_a_chunked_body_is_cut_off_at_the_limit_not_read_whole(tmp_path):
    """No Content-Length (chunked): the gateway reads up to its limit and answers 413 there; a
    100 MB body (a huge ``user`` string, say) is never read in full. A small chunked body passes."""
    sent = []

    async def huge():
        yield b'{"messages": [{"role": "user", "content": "hi"}], "user": "'
        for _ in range(100):
            sent.append(1)
            yield b"u" * (1 << 20)
        yield b'"}'

    async def small():
        yield json.dumps({"messages": MSG}).encode()

    async def scenario():
        async with gateway(tmp_path, max_text_chars=1000) as (app, client, redis):
            big = await client.post("/v1/chat/completions", content=huge(), headers={"content-type": "application/json"})
            async with answering(redis):
                ok = await client.post("/v1/chat/completions", content=small(),
                                       headers={"content-type": "application/json"})
            return big, ok

    big, ok = asyncio.run(scenario())
    assert big.status_code == 413 and big.json()["error"]["code"] == "body_too_large"
    assert len(sent) <= 2, f"read {len(sent)} MB of a body whose limit is far below 1 MB"
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("extra,param", [({"user": "u" * 257}, "user"),
                                         ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
                                         ({"metadata": {"k": "v" * 513}}, "metadata")])
def test_user_and_metadata_are_bounded(tmp_path, extra, param):
    _, r, queued = post_alone(tmp_path, "/v1/chat/completions", {"messages": MSG, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and queued == 0, r.text


def test_unexpected_error_hides_the_exception(tmp_path, monkeypatch):
    async def scenario():
        async with gateway(tmp_path) as (app, _, _r):
            async def boom(*_a, **_k):
                raise RuntimeError("probability tensor contains either inf, nan or element < 0")
            monkeypatch.setattr(app.state.predictor, "predict_bounds", boom)
            transport = httpx.ASGITransport(app, raise_app_exceptions=False)  # as a server answers
            async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
                r = await client.post("/v1/generate", json={"input": "hi", "max_tokens": 4},
                                      headers={"x-request-id": "client-42"})
            return app, r, await app.state.redis.zcard(bus.pool_keys("default").reservations)

    app, r, reserved = asyncio.run(scenario())
    assert reserved == 0  # the slot it had reserved is given back
    assert r.status_code == 500
    err = r.json()["error"]
    assert "tensor" not in err["message"] and err["request_id"] == "client-42" and err["code"] == "internal_error"
    assert _rows(app) == 0  # failed before its record: nothing half-written
