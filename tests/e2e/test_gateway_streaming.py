"""The gateway streams upstream rows itself (COHORT_UPSTREAM_STREAMING=gateway): two simulated
engines (`cohort engine-sim`, fixed delays, behind an API key; one dies mid-stream after a few
requests), the real gateway, batcher, upstream workers and Redis, the `openai` SDK as the client. Answers whole and
exact, a stop string found by the gateway, no token crossing Redis, a client that leaves closes its
engine stream, and an engine killed mid-stream: its rows continue on the other, nothing lost."""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time

import httpx
import pytest
from openai import AsyncOpenAI, OpenAI

from bench.front_bench import fixed_delay_engines
from cohort import bus
from tests.e2e.scenarios import leave_after_first_text
from tests.e2e.stack import TestStack

pytestmark = pytest.mark.e2e
MODEL = "cohort/tiny-random-llama"
ENGINE_KEY = "engine-key"


@pytest.fixture(scope="module")
def streaming_stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("direct")
    # the engines ask for a key (vLLM's --api-key): the workers' probes and the gateway's streams send it
    with fixed_delay_engines(2, 5.0, 4.0, folder, api_key=ENGINE_KEY) as engines:
        stack = TestStack(folder / "stack", COHORT_UPSTREAMS=",".join(url for _, url in engines),
                          COHORT_UPSTREAM_STREAMING="gateway", COHORT_UPSTREAM_TIMEOUT_S="5",
                          COHORT_UPSTREAM_API_KEY=ENGINE_KEY)
        try:
            stack.start()
            yield stack, engines
        finally:
            stack.stop()


def _client(stack: TestStack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


def _deltas_in_redis(stack: TestStack, rid: str) -> int:
    return sum(1 for _, f in stack.redis.xrange(bus.stream_key(rid)) if '"kind":"delta"' in f[bus.STREAM_FIELD])


def test_answers_stream_from_the_gateway_whole_and_exact(streaming_stack):
    stack, _ = streaming_stack
    c = _client(stack)
    chunks = list(c.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=24, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason] == ["length"]
    assert [ch.usage.completion_tokens for ch in chunks if ch.usage] == [24] and text
    rid = chunks[0].id.removeprefix("cmpl-")
    assert _deltas_in_redis(stack, rid) == 0, "a token crossed Redis"
    whole = c.completions.create(model=MODEL, prompt="Tell me a story.", max_tokens=24, n=2,
                                 extra_body={"ignore_eos": True})
    assert [ch.finish_reason for ch in whole.choices] == ["length", "length"] and whole.usage.completion_tokens == 48
    chat = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6)
    assert chat.usage.completion_tokens == 6 and chat.choices[0].finish_reason == "length"
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT status, actual_tokens FROM requests WHERE id = ?", (rid,)).fetchone() == ("done", 24)


def test_a_stop_string_ends_the_answer_at_the_gateway(streaming_stack):
    stack, _ = streaming_stack
    c = _client(stack)
    full = c.completions.create(model=MODEL, prompt="List.", max_tokens=30, seed=3, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3]
    cut = c.completions.create(model=MODEL, prompt="List.", max_tokens=30, seed=3, stop=[stop],
                               extra_body={"ignore_eos": True})
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == text[:text.index(stop)]


def _running(url: str) -> float:
    text = httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(r'^vllm:num_requests_running\{[^}]*\} (\S+)$', text, re.M))


def test_a_client_that_leaves_closes_its_engine_stream(streaming_stack):
    stack, engines = streaming_stack
    rid = leave_after_first_text(_client(stack).completions.create(
        model=MODEL, prompt="Go on.", max_tokens=2000, stream=True, extra_body={"ignore_eos": True}))
    con = sqlite3.connect(stack.db_path)
    deadline = time.time() + 30
    while time.time() < deadline and (sum(_running(u) for _, u in engines) or con.execute(
            "SELECT status FROM requests WHERE id = ?", (rid,)).fetchone() != ("cancelled",)):
        time.sleep(0.2)
    assert sum(_running(u) for _, u in engines) == 0
    assert con.execute("SELECT status FROM requests WHERE id = ?", (rid,)).fetchone() == ("cancelled",)


def test_an_engine_killed_mid_stream_loses_nothing(streaming_stack):
    stack, engines = streaming_stack

    async def scenario():
        client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
        tasks = [asyncio.ensure_future(client.completions.create(
            model=MODEL, prompt=f"Item {i}.", max_tokens=200, extra_body={"ignore_eos": True})) for i in range(8)]
        await asyncio.sleep(0.4)  # rows stream on both engines
        engines[0][0].kill()
        return await asyncio.gather(*tasks, return_exceptions=True)

    answers = asyncio.run(scenario())
    assert all(not isinstance(a, Exception) for a in answers), answers
    assert [a.usage.completion_tokens for a in answers] == [200] * 8
    assert all(a.choices[0].finish_reason == "length" for a in answers)
