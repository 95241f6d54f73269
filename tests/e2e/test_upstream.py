"""cohort in front of real upstream engines: two `transformers serve --continuous-batching`
servers (separate processes) on the built-in model exported with `cohort worker export-model`,
one upstream worker each (COHORT_UPSTREAMS), the real gateway, batcher and Redis; the `openai`
SDK is the client. Streaming, n, stop strings, a client that leaves, and one server killed with
-9 while its rows stream: nothing lost, every answer complete."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from cohort import bus
from cohort.protocol import StreamEvent
from procstack.stack import free_port
from tests.e2e.scenarios import leave_after_first_text
from tests.e2e.stack import TestStack, export_model, wait_for_server

pytestmark = pytest.mark.e2e
TRANSFORMERS = Path(sys.executable).with_name("transformers")


def _serve(model_dir: Path, log: Path) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    p = subprocess.Popen([str(TRANSFORMERS), "serve", str(model_dir), "--continuous-batching", "--device", "cpu",
                          # its KV pool would take most of the host's memory by default: 16,384 tokens
                          "--cb-block-size", "64", "--cb-num-blocks", "256",
                          "--host", "127.0.0.1", "--port", str(port), "--log-level", "info"],
                         stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    return p, f"http://127.0.0.1:{port}", log


@pytest.fixture(scope="module")
def upstream_stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("upstream")
    model_dir = export_model(folder)
    servers = [_serve(model_dir, folder / f"serve-{i}.log") for i in range(2)]
    stack = None
    try:
        for proc, url, log in servers:
            wait_for_server(url, proc, log, 120.0)
        stack = TestStack(folder / "stack", COHORT_UPSTREAMS=",".join(f"{u}/v1" for _, u, _ in servers),
                          COHORT_UPSTREAM_KV_TOKENS="8192", COHORT_UPSTREAM_TIMEOUT_S="20")
        stack.start()
        yield stack, servers
    finally:
        if stack is not None:
            stack.stop()
            for name in stack.procs:
                print(stack.tail(name, 40))
        for proc, _, _ in servers:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _client(stack: TestStack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)


def test_streamed_completion_through_an_upstream(upstream_stack):
    stack, _ = upstream_stack
    chunks = list(_client(stack).completions.create(model="cohort/tiny-random-llama", prompt="Tell me a story.",
                                                    max_tokens=24, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage]
    assert text.strip() and finish == ["length"]
    assert usage and usage[-1].completion_tokens == 24
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT status, actual_tokens FROM requests ORDER BY created DESC LIMIT 1").fetchone() == (
        "done", 24)
    deadline = time.time() + 30  # the batch row is written when its group's completion is
    while time.time() < deadline and not con.execute("SELECT COUNT(*) FROM batches").fetchone()[0]:
        time.sleep(0.2)
    assert con.execute("SELECT instance FROM batches").fetchone()[0].endswith("-upstream")


def test_n_choices_and_stop_strings(upstream_stack):
    stack, _ = upstream_stack
    c = _client(stack)
    both = c.completions.create(model="cohort/tiny-random-llama", prompt="List some fruit.", max_tokens=12, n=2,
                                temperature=0)
    assert len(both.choices) == 2 and both.usage.completion_tokens == 24
    full = both.choices[0].text
    assert len(full) >= 8, full
    stop = full[4:7]
    cut = c.completions.create(model="cohort/tiny-random-llama", prompt="List some fruit.", max_tokens=12,
                               temperature=0, stop=[stop])
    # greedy on the same weights: the same text, ended where the stop string first appears
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == full[:full.index(stop)]


def _finish_reasons(c: OpenAI, model: str, **extra) -> tuple:
    """What a client reads as an answer's end, whole and streamed, and the whole answer's text."""
    whole = c.completions.create(model=model, prompt="List some fruit.", max_tokens=12, temperature=0, **extra)
    chunks = c.completions.create(model=model, prompt="List some fruit.", max_tokens=12, temperature=0,
                                  stream=True, **extra)
    return (whole.choices[0].finish_reason,
            [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason],
            whole.choices[0].text)


def test_finish_reasons_are_the_servers(upstream_stack):
    """max_tokens reached: "length" from the server and from cohort, whole and streamed. A stop
    string: `transformers serve` does not apply ``stop`` to completions (it answers all 12 tokens,
    "length"); cohort finds it in the server's text and ends the answer there with "stop"."""
    stack, servers = upstream_stack
    direct = OpenAI(base_url=f"{servers[1][1]}/v1", api_key="none", max_retries=0, timeout=120)
    model = direct.models.list().data[0].id  # the one cohort's worker sends to
    theirs = _finish_reasons(direct, model)
    assert theirs[:2] == ("length", ["length"])
    assert _finish_reasons(_client(stack), "cohort/tiny-random-llama") == theirs
    stop = theirs[2][4:7]
    ignored = _finish_reasons(direct, model, stop=[stop])
    cut = _finish_reasons(_client(stack), "cohort/tiny-random-llama", stop=[stop])
    assert ignored == theirs, "transformers serve applies stop strings now: compare them too"
    assert cut == ("stop", ["stop"], theirs[2][:theirs[2].index(stop)])


def test_a_client_that_leaves_stops_its_upstream_row(upstream_stack):
    stack, _ = upstream_stack
    request_id = leave_after_first_text(_client(stack).completions.create(
        model="cohort/tiny-random-llama", prompt="Tell me a story.", temperature=0, max_tokens=2000, stream=True))
    con = sqlite3.connect(stack.db_path)
    deadline = time.time() + 60
    while time.time() < deadline and (stack.redis.hlen(bus.pool_keys("default").inflight)
                                      or not stack.redis.exists(bus.cancel_key(request_id))):
        time.sleep(0.2)
    assert stack.redis.hlen(bus.pool_keys("default").inflight) == 0, "the group ends once its only row is dropped"
    assert con.execute("SELECT status FROM requests WHERE id = ?", (request_id,)).fetchone() == ("cancelled",)
    events = [StreamEvent.from_json(f[bus.STREAM_FIELD]) for _, f in stack.redis.xrange(bus.stream_key(request_id))]
    assert not any(e.final for e in events) and max((e.tokens for e in events), default=0) < 2000


def test_an_upstream_killed_mid_stream_loses_nothing(upstream_stack):
    stack, servers = upstream_stack
    bodies = [{"instruction": "Echo.", "input": f"item {i}", "max_tokens": 120, "emulated_tokens": 120}
              for i in range(8)]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=stack.url, timeout=300) as h:
            tasks = [asyncio.create_task(h.post("/v1/generate", json=b)) for b in bodies]
            await asyncio.sleep(4.0)  # both servers stream rows by now
            servers[0][0].send_signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    answers = asyncio.run(scenario())
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers]
    assert [r.json()["generated_tokens"] for r in answers] == [120] * 8
    # the killed server's worker withdraws at its next heartbeat (every COHORT_INSTANCE_TTL_S / 3,
    # which may come after the last answer); the pool keeps serving on the other one
    deadline = time.time() + 90  # a starved host stretches the heartbeat
    while True:
        health = httpx.get(f"{stack.url}/health", timeout=5).json()
        if len(health["instances"]) == 1 or time.time() > deadline:
            break
        time.sleep(0.5)
    assert health["status"] == "ok" and len(health["instances"]) == 1, health
    stats = stack.redis.hgetall("cohort:stats")
    assert int(stats.get("requests_failed", 0)) == 0
