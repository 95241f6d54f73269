"""Per-request sampling parameters: validated with clear 400s, passed through to the worker."""

from __future__ import annotations

import asyncio

import pytest

from cohort.types import SamplingParams
from tests.gateway.harness import MSG, gateway, post_alone, worker


def test_sampling_parameters_reach_the_worker(tmp_path):
    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            w = asyncio.create_task(worker(redis, ["ok"]))
            r = await client.post("/v1/chat/completions", json={
                "messages": MSG, "temperature": 0.7, "top_p": 0.9, "seed": 5, "stop": ["\n", "END"],
                "presence_penalty": 0.5, "frequency_penalty": -1.5, "logit_bias": {"100": -100, "7": 2.5},
                "top_k": 40, "repetition_penalty": 1.2})
            req = await w
            w = asyncio.create_task(worker(redis, ["ok"]))
            g = await client.post("/v1/generate", json={"input": "x", "stop": "###", "top_k": -1})
            return r, req, g, await w

    r, req, g, greq = asyncio.run(scenario())
    assert r.status_code == 200 and g.status_code == 200, (r.text, g.text)
    assert req.sampling == SamplingParams(temperature=0.7, top_p=0.9, seed=5, top_k=40, repetition_penalty=1.2,
                                          presence_penalty=0.5, frequency_penalty=-1.5,
                                          logit_bias=((7, 2.5), (100, -100.0)), stop=("\n", "END"))
    assert greq.sampling == SamplingParams(stop=("###",))  # top_k -1 = off = 0


@pytest.mark.parametrize("extra,param", [
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, "logit_bias"),   # beyond the vocabulary
    ({"top_k": -2}, "top_k"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"temperature": 3}, "temperature"),
])
def test_out_of_range_is_a_clear_400(tmp_path, extra, param):
    _, r, queued = post_alone(tmp_path, "/v1/chat/completions", {"messages": MSG, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error" and err["message"]
    assert queued == 0
