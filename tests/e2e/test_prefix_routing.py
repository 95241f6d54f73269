"""Prefix-aware routing on the real stack: two built-in worker processes in one pool, each with its own
prefix cache. Five chats, each under its own long system prompt, then a second turn of each: every
second turn goes to the instance that served the first (the batcher routes it there), so every one
finds the system prompt in that instance's cache. From the pool queue, sequential batches go to the
two blocked workers in turn, so with an odd number of chats the second turns would each land on the
instance that never saw their prompt (measured: with COHORT_PREFIX_ROUTING=false the cache
assertion fails)."""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from cohort import bus

pytestmark = pytest.mark.e2e
STACK_ENV = {"COHORT_SERVED_MODEL_NAME": "cohort-tiny"}
MODEL = "cohort-tiny"
TOPICS = ["static batching", "KV caches", "tokenizers", "speculative decoding", "LoRA adapters"]


def test_each_second_turn_goes_where_its_system_prompt_is_cached(stack):
    stack.spawn("worker-2", "worker")
    deadline = time.time() + 240
    while time.time() < deadline and stack.redis.hlen(bus.INSTANCES) < 2:
        time.sleep(0.5)
    assert stack.redis.hlen(bus.INSTANCES) == 2, stack.tail("worker-2")
    # registered is not yet alive to the batcher: wait until it routes among both (a slow host
    # may take seconds between a worker's registration and its first heartbeat)
    while time.time() < deadline and not any(line.count("'vm-") == 2 for line in stack.tail("batcher", 400)
                                             .splitlines() if "instances in pool" in line):
        time.sleep(0.5)
    client = OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)

    def turn(topic: str, question: str):
        system = {"role": "system", "content": f"{topic}: you answer questions about {topic}, briefly. " * 6}
        return client.chat.completions.create(model=MODEL, messages=[system, {"role": "user", "content": question}],
                                              max_tokens=3, extra_body={"ignore_eos": True})

    firsts = [turn(t, "Why?") for t in TOPICS]
    assert all(f.usage.prompt_tokens_details.cached_tokens == 0 for f in firsts)
    seconds = [turn(t, "And how?") for t in TOPICS]
    cached = [s.usage.prompt_tokens_details.cached_tokens for s in seconds]
    assert all(c >= 64 for c in cached), cached
    routed = [line for line in stack.tail("batcher", 400).splitlines() if "its prefix is cached there" in line]
    assert len(routed) >= len(TOPICS), stack.tail("batcher", 60)
