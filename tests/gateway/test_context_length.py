"""A pool's context length is its instances' own: ``/v1/models`` reports the smallest of its live
instances' (an upstream's ``max_model_len``, the built-in model's positions), a prompt that leaves
no room is refused, and a ``max_tokens`` past the context is planned as what fits, as vLLM runs it
(its answer then ends with ``finish_reason: "length"``)."""

from __future__ import annotations

import asyncio

import pytest

from cohort import bus
from cohort.settings import DEFAULT_MODEL
from cohort.tokenizer import prompt_token_ids
from gateway.submit import Submission, within_context
from tests.gateway.harness import gateway, next_request, register

PROMPT = "one two three four five six seven eight"


def _prompt_len() -> int:
    return len(prompt_token_ids([PROMPT], DEFAULT_MODEL)[0])


@pytest.mark.slow  # 0.67 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_models_report_the_smallest_live_context_and_requests_are_planned_within_it(tmp_path):
    n = _prompt_len()

    async def scenario():
        async with gateway(tmp_path, served_model_name="tiny", request_timeout_s=0.3) as (_, client, redis):
            # the default pool: the harness's instance (no context known) and two that say theirs;
            # the dead one's smaller context does not count
            await register(redis, "up-a", "default", DEFAULT_MODEL, max_model_len=n + 40)
            await register(redis, "up-b", "default", DEFAULT_MODEL, max_model_len=n + 60)
            await register(redis, "up-dead", "default", DEFAULT_MODEL, max_model_len=n + 5, alive=False)
            models = (await client.get("/v1/models")).json()["data"]
            _, req_clipped = await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 200}), next_request(redis))
            _, req_inside = await asyncio.gather(
                client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 10}), next_request(redis))
            return models, req_clipped, req_inside

    models, req_clipped, req_inside = asyncio.run(scenario())
    assert models[0]["max_model_len"] == n + 40
    assert req_clipped.max_tokens == 40 and req_clipped.input_tokens == n
    assert req_inside.max_tokens == 10


def test_a_prompt_that_fills_the_context_is_refused_and_nothing_is_queued(tmp_path):
    n = _prompt_len()

    async def scenario():
        async with gateway(tmp_path) as (_, client, redis):
            await register(redis, "up-a", "default", DEFAULT_MODEL, max_model_len=n)
            chat = await client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4})
            return chat, await redis.llen(bus.pool_keys("default").incoming)

    r, queued = asyncio.run(scenario())
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt" and str(n) in err["message"]
    assert queued == 0


def test_within_context_clips_an_emulated_length_with_the_budget():
    sub = Submission(instruction="", user_input="x", max_tokens=100, emulated_tokens=90)
    assert within_context(sub, 10, 1000) is sub
    clipped = within_context(sub, 950, 1000)
    assert clipped.max_tokens == 50 and clipped.emulated_tokens == 50
