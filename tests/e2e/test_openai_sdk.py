"""The official ``openai`` SDK against a real stack with two model pools: models.list/retrieve,
chat, completions, streaming, n > 1, prompt lists, stop, logprobs, and the SDK's error mapping
(404 unknown model, 400 unsupported field). The second pool is a second worker and batcher with
``COHORT_POOL=pool-b`` (one `cohort serve` is one pool; compose shows the multi-pool shape)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time

import httpx
import openai
import pytest
from openai import OpenAI

from cohort import bus

pytestmark = pytest.mark.e2e
STACK_ENV = {"COHORT_SERVED_MODEL_NAME": "cohort-tiny"}
MODEL, MODEL_B = "cohort-tiny", "tiny-b"
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)


@pytest.fixture(scope="module")
def pool_b(stack) -> str:
    """A second pool in the same stack: its own worker (instance ``worker-b``) and batcher."""
    env = {**stack.env, "COHORT_POOL": "pool-b", "COHORT_SERVED_MODEL_NAME": MODEL_B,
           "COHORT_INSTANCE_NAME": "worker-b"}
    for name, args in (("worker-b", ("worker",)), ("batcher-b", ("batcher",))):
        log = open(stack.folder / f"{name}.log", "ab")  # closed with the process
        stack.procs[name] = subprocess.Popen([sys.executable, "-m", "launch.cli", *args], env=env, stdout=log,
                                             stderr=subprocess.STDOUT)
    deadline = time.time() + 240
    while time.time() < deadline:
        assert not stack.dead(), stack.tail(stack.dead()[0])
        if stack.redis.exists(bus.alive_key("worker-b")) and stack.redis.exists(
                bus.pool_keys("pool-b").batcher_lock):
            return MODEL_B
        time.sleep(0.5)
    raise TimeoutError("pool-b did not come up:\n" + stack.tail("worker-b") + stack.tail("batcher-b"))


def test_models_list_every_pool(client, pool_b):
    models = {m.id: m for m in client.models.list()}
    assert set(models) == {MODEL, pool_b}
    assert models[MODEL].owned_by == "cohort" and models[MODEL].model_extra["pool"] == "default"
    assert models[pool_b].model_extra["pool"] == "pool-b" and models[pool_b].model_extra["max_model_len"] > 0
    assert client.models.retrieve(MODEL).id == MODEL


def test_model_routes_to_its_pool(client, stack, pool_b):
    r = client.completions.create(model=pool_b, prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True})
    assert r.model == pool_b and r.usage.completion_tokens == 4
    con = sqlite3.connect(stack.db_path)
    deadline = time.time() + 30  # the batch is recorded just after its last answer went out
    while time.time() < deadline and not con.execute("SELECT 1 FROM batches WHERE instance = 'worker-b'").fetchone():
        time.sleep(0.2)
    assert con.execute("SELECT 1 FROM batches WHERE instance = 'worker-b'").fetchone()


def test_chat_and_completions(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5,
                                          extra_body={"ignore_eos": True})
    assert chat.model == MODEL and chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"
    comp = client.completions.create(model=MODEL, prompt=["Once upon", "a time"], n=2, max_tokens=3,
                                     extra_body={"ignore_eos": True})
    assert [c.index for c in comp.choices] == [0, 1, 2, 3] and comp.usage.completion_tokens == 12
    tokens = client.completions.create(model=MODEL, prompt=[2023, 2003, 1037], max_tokens=2, echo=True,
                                       extra_body={"ignore_eos": True})
    assert tokens.usage.prompt_tokens == 3 and tokens.choices[0].text.startswith("this is a")


def test_a_shared_system_prompt_comes_from_the_prefix_cache(client, stack):
    """Two chats with one long system prompt, one after the other: the second's prompt pages come
    from the instance's prefix cache, as its usage, its log-DB row and /metrics say."""
    system = {"role": "system", "content": "You answer questions about static batching of LLM requests. " * 8}
    first = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "Why?"}],
                                           max_tokens=3, extra_body={"ignore_eos": True})
    second = client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": "How?"}],
                                            max_tokens=3, extra_body={"ignore_eos": True})
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert cached >= 64 and cached % 16 == 0 and cached < second.usage.prompt_tokens
    rid = second.id.removeprefix("chatcmpl-")
    con = sqlite3.connect(stack.db_path)
    deadline = time.time() + 30
    while time.time() < deadline and not con.execute("SELECT cached_tokens FROM requests WHERE id = ? AND "
                                                     "status = 'done'", (rid,)).fetchone():
        time.sleep(0.2)
    assert con.execute("SELECT cached_tokens FROM requests WHERE id = ?", (rid,)).fetchone() == (cached,)
    metrics = httpx.get(f"{stack.url}/metrics").text
    hits = [line for line in metrics.splitlines() if line.startswith("cohort_prefix_cache_hits_total{")]
    assert hits and sum(float(line.rsplit(" ", 1)[1]) for line in hits) >= cached


def _stream_two_choices(client, **kw) -> list[str]:
    seen: dict[int, list[str]] = {0: [], 1: []}
    finish: dict[int, str] = {}
    usage = None
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, n=2, max_tokens=6, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True}, **kw):
        usage = chunk.usage or usage
        for c in chunk.choices:
            seen[c.index].append(c.delta.content or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "length", 1: "length"} and usage.completion_tokens == 12
    return ["".join(seen[0]), "".join(seen[1])]


def test_streaming_n_choices(client):
    """OpenAI's default temperature is 1: two choices are two samples; greedy ones are equal."""
    sampled = _stream_two_choices(client)
    assert all(sampled) and sampled[0] != sampled[1]
    greedy = _stream_two_choices(client, temperature=0)
    assert greedy[0] and greedy[0] == greedy[1]


def test_stop_cuts_the_answer(client):
    whole = client.completions.create(model=MODEL, prompt="The weather today", max_tokens=24,
                                      temperature=0).choices[0].text
    assert len(whole) > 8, whole
    stop = whole[4:7]
    cut = client.completions.create(model=MODEL, prompt="The weather today", max_tokens=24, stop=[stop],
                                    temperature=0).choices[0]
    assert cut.text == whole[:whole.index(stop)] and cut.finish_reason == "stop"


def test_logprobs(client):
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                          top_logprobs=3, temperature=0, extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 6
    for item in content:  # greedy: the chosen token is the most likely one
        assert len(item.top_logprobs) == 3 and item.top_logprobs[0].logprob == pytest.approx(item.logprob)
        assert item.logprob <= 0
    comp = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=5, logprobs=2,
                                     temperature=0, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == 5 and len(lp.text_offset) == 5
    text = comp.choices[0].text
    assert "".join(lp.tokens) == text  # OpenAI's shape: pieces of the text, offsets into it
    assert all(text[o:o + len(t)] == t for t, o in zip(lp.tokens, lp.text_offset, strict=True))
    streamed = []
    for chunk in client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=6, logprobs=True,
                                                stream=True, temperature=0, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            if c.logprobs and c.logprobs.content:
                streamed += [x.logprob for x in c.logprobs.content]
    assert streamed == pytest.approx([x.logprob for x in content])


def test_echo_with_logprobs_scores_the_prompt(client):
    """What lm-eval's log-likelihood sends: a token-id prompt, echo, logprobs, max_tokens 1 (or 0:
    the prompt only). The prompt's tokens come first, the first with no logprob; vLLM's
    prompt_logprobs carries the same numbers with ranks."""
    ids = [2023, 4937, 2938, 2006, 1996, 13523]
    one = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True, logprobs=1, temperature=0)
    choice = one.choices[0]
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == choice.text
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()))  # greedy: the top one
    zero = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
    assert zero.usage.completion_tokens == 0 and zero.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:-1])
    vllm = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2})
    scores = vllm.choices[0].model_extra["prompt_logprobs"]
    assert scores[0] is None and len(scores) == len(ids)
    for tok, entry, want in zip(ids[1:], scores[1:], lp.token_logprobs[1:-1], strict=True):
        assert entry[str(tok)]["logprob"] == pytest.approx(want) and entry[str(tok)]["rank"] >= 1
        assert len(entry) >= 2


def test_errors_map_to_the_sdks_exceptions(client, stack):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o-does-not-exist", messages=MESSAGES)
    assert e.value.status_code == 404 and e.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    assert e.value.body["param"] == "tools" and e.value.code == "unsupported_parameter"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, response_format={"type": "json_object"})
    assert e.value.body["param"] == "response_format"
    assert httpx.get(f"{stack.url}/v1/models/nope").status_code == 404
