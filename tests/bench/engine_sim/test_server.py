"""The simulator over loopback with the real ``openai`` SDK as its client: vLLM's shapes, usage and
cached tokens, token ids, 429, and the names on /metrics."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

# cohort's upstream client, which must read the simulator exactly as it reads vLLM
from upstream.api import block_tokens_from_metrics, gauge, kv_tokens_from_metrics, queue_from_metrics


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="sim", max_retries=0, timeout=10)


def test_models_lists_the_name_and_max_model_len(sim) -> None:
    with sim(model_name="m1", max_model_len=1000) as s:
        models = client(s.url).models.list().data
    assert [m.id for m in models] == ["m1"]
    assert models[0].model_extra["max_model_len"] == 1000
    assert models[0].model_extra["engine_sim"]["speedup"] == 100.0


def test_completion_whole_and_streamed(sim, token_table) -> None:
    with sim() as s:
        c = client(s.url)
        whole = c.completions.create(model="sim-model", prompt="hello there world", max_tokens=7,
                                     extra_body={"return_token_ids": True})
        chunks = list(c.completions.create(model="sim-model", prompt="hello there world", max_tokens=7,
                                           stream=True, stream_options={"include_usage": True},
                                           extra_body={"return_token_ids": True}))
    choice = whole.choices[0]
    ids = choice.model_extra["token_ids"]
    assert len(ids) == 7 and choice.finish_reason == "length"
    assert choice.text == token_table.text_of(ids)
    assert token_table.encode(choice.text, add_special_tokens=False) == ids   # text re-tokenizes to the ids
    assert choice.model_extra["prompt_token_ids"] == token_table.encode("hello there world")
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (5, 7, 12)
    texts = [ch.choices[0] for ch in chunks if ch.choices]
    assert len(texts) == 7 and texts[-1].finish_reason == "length"
    assert [t.model_extra["token_ids"][0] for t in texts] == ids       # same prompt, same answer
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7


def test_chat_whole_and_streamed(sim) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with sim() as s:
        c = client(s.url)
        whole = c.chat.completions.create(model="sim-model", messages=msgs, max_tokens=4)
        chunks = list(c.chat.completions.create(model="sim-model", messages=msgs, max_completion_tokens=4,
                                                stream=True, stream_options={"include_usage": True}))
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 4
    deltas = [ch.choices[0].delta for ch in chunks if ch.choices]
    assert deltas[0].role == "assistant" and deltas[0].content == ""
    assert "".join(d.content or "" for d in deltas) == whole.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_repeated_prompt_reports_cached_tokens(sim) -> None:
    prompt = list(range(2000, 2064))                        # 64 token ids: 4 blocks of 16
    with sim() as s:
        c = client(s.url)
        first = c.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
        second = c.completions.create(model="sim-model", prompt=prompt, max_tokens=2)
        text = s.call(lambda: s.server.metrics.render())
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 48   # the last block is recomputed
    assert gauge(text, "vllm:prefix_cache_hits_total") == 48
    assert gauge(text, "vllm:prefix_cache_queries_total") == 128


def test_metrics_parse_and_read_as_cohort_reads_vllm(sim) -> None:
    with sim(num_gpu_blocks=300, block_size=32, max_model_len=4096) as s:
        client(s.url).completions.create(model="sim-model", prompt="one two", max_tokens=3)
        text = s.call(lambda: s.server.metrics.render())
    names = {f.name for f in text_string_to_metric_families(text)}
    for name in ("vllm:cache_config_info", "vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
                 "vllm:num_preemptions", "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert name in names, name
    assert kv_tokens_from_metrics(text) == (300 - 1) * 32 and block_tokens_from_metrics(text) == 32
    assert queue_from_metrics(text) == 0.0
    assert 'model_name="sim-model"' in text


def test_priority_is_refused_unless_the_policy_is_priority(sim) -> None:
    with sim() as s, pytest.raises(openai.BadRequestError, match="[Pp]riority"):
        client(s.url).completions.create(model="sim-model", prompt="x", max_tokens=1, extra_body={"priority": 3})
    with sim(scheduling_policy="priority") as s:
        r = client(s.url).completions.create(model="sim-model", prompt="x", max_tokens=1, extra_body={"priority": 3})
    assert r.usage.completion_tokens == 1


def test_a_full_waiting_queue_answers_429(sim) -> None:
    async def run(url: str) -> list:
        c = openai.AsyncOpenAI(base_url=url, api_key="sim", max_retries=0, timeout=10)
        long = await c.completions.create(model="sim-model", prompt="a", max_tokens=400, stream=True)
        first = await long.__anext__()          # running: the only seat
        waiting = asyncio.ensure_future(c.completions.create(model="sim-model", prompt="b", max_tokens=1))
        await asyncio.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as e:
            await c.completions.create(model="sim-model", prompt="c", max_tokens=1)
        await long.close()                      # the client leaves: its request is aborted
        done = await waiting
        return [first, e.value, done]

    with sim(max_num_seqs=1, max_waiting=1, speedup=1.0) as s:
        first, err, done = asyncio.run(run(s.url))
        state = s.call(lambda: (s.server.engine.gauges(), s.server.metrics.aborted))
    assert err.status_code == 429 and err.body["type"] == "RateLimitError"
    assert done.usage.completion_tokens == 1
    gauges, aborted = state
    assert gauges["running"] == 0 and gauges["kv_usage"] == 0.0 and aborted == 1


def test_stream_interval_groups_tokens(sim) -> None:
    async def run(url: str) -> list[list[int]]:
        body = {"model": "sim-model", "prompt": "x y", "max_tokens": 10, "stream": True,
                "return_token_ids": True, "stream_interval": 4}
        out = []
        async with aiohttp.ClientSession() as h, h.post(f"{url}/completions", json=body) as r:
            async for line in r.content:
                if line.startswith(b"data: {"):
                    out.append(json.loads(line[6:])["choices"][0]["token_ids"])
        return out

    with sim(ttft_ms=1.0, itl_ms=1.0) as s:
        groups = asyncio.run(run(s.url))
    assert [len(g) for g in groups] == [1, 4, 4, 1]


def test_preemption_under_kv_pressure_still_answers_everyone(sim) -> None:
    """Eight concurrent streams on a pool that holds about two of them whole: requests are
    preempted and resumed by recompute, and each still gets exactly its tokens."""
    async def run(url: str) -> list[int]:
        c = openai.AsyncOpenAI(base_url=url, api_key="sim", max_retries=0, timeout=20)

        async def one(i: int) -> int:
            s = await c.completions.create(model="sim-model", prompt=list(range(3000 + 100 * i, 3000 + 100 * i + 40)),
                                           max_tokens=30, stream=True)
            return sum(len(ch.choices[0].text) > 0 for ch in [x async for x in s] if ch.choices)
        return await asyncio.gather(*(one(i) for i in range(8)))

    with sim(num_gpu_blocks=1 + 12, block_size=16, max_model_len=160, speedup=200.0) as s:
        counts = s.run(run(s.url))             # on the server's loop: no two threads taking turns
        gauges = s.call(lambda: s.server.engine.gauges())
    assert counts == [30] * 8
    assert gauges["preemptions"] > 0 and gauges["running"] == 0 and gauges["kv_usage"] == 0.0


def test_a_step_that_starts_late_is_counted(sim) -> None:
    """A loop held past the step's deadline (a busy box) starts the next step late: the counter a
    fleet run reads to say whether the box kept the model clock."""
    with sim(speedup=1.0) as s:
        stream = client(s.url).completions.create(model="sim-model", prompt="one two", max_tokens=200, stream=True,
                                                  extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)                            # running: its decode steps are due every few ms
        s.call(lambda: time.sleep(0.3))         # the server's loop held for 300 ms
        rest = sum(1 for _ in chunks)
        text = s.call(lambda: s.server.metrics.render())
    assert rest >= 1
    assert gauge(text, "engine_sim_late_steps_total") >= 1
    assert gauge(text, "engine_sim_steps_total") >= gauge(text, "engine_sim_late_steps_total")
