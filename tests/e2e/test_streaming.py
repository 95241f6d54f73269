"""Token streaming through the real stack, driven by the real ``openai`` SDK: deltas arrive while
the answer is generated, concatenate to the non-streaming answer, and a client that leaves
stops its row's computation."""

from __future__ import annotations

import sqlite3
import time

import httpx
import pytest
from openai import OpenAI
from prometheus_client.parser import text_string_to_metric_families

from cohort import bus
from cohort.protocol import StreamEvent

pytestmark = pytest.mark.e2e
MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Tell me a story."}]


def _client(stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.url}/v1", api_key="unused", timeout=120, max_retries=0)


def test_openai_sdk_streams_chat_deltas_before_the_end(stack):
    client = _client(stack)
    n = 96
    t0 = time.monotonic()
    arrivals: list[tuple[float, str | None, str | None]] = []
    usage = None
    for chunk in client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=n, stream=True,
                                                stream_options={"include_usage": True}, temperature=0,
                                                extra_body={"ignore_eos": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            arrivals.append((time.monotonic() - t0, choice.delta.content, choice.finish_reason))
    contents = [(t, c) for t, c, _ in arrivals if c]
    finish_at = [t for t, _, f in arrivals if f is not None]
    assert len(contents) > 1, arrivals
    assert len(finish_at) == 1 and [f for *_, f in arrivals if f] == ["length"]
    spread = finish_at[0] - contents[0][0]
    print(f"first text at {contents[0][0]:.3f} s, finish at {finish_at[0]:.3f} s, {len(contents)} text chunks")
    assert spread > 0.1 * finish_at[0], "text arrived only at the end: not streamed"
    assert usage is not None and usage.completion_tokens == n

    streamed = "".join(c for _, c in contents)
    whole = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=n, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert whole.choices[0].message.content == streamed
    assert whole.usage.completion_tokens == n

    chat = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(f"{stack.url}/metrics").text)
            for s in fam.samples if s.labels.get("endpoint") == "chat"}
    for name in ("time_to_first_token", "request_queue_time", "e2e_request_latency"):
        assert chat[f"cohort_{name}_seconds_count"] == 2, name  # one per request
    assert chat["cohort_inter_token_latency_seconds_count"] >= len(contents) - 1  # one per gap


def test_openai_sdk_streams_completions(stack):
    client = _client(stack)
    texts, reasons = [], []
    for chunk in client.completions.create(model="default", prompt="Once upon a time", max_tokens=12, stream=True,
                                           extra_body={"ignore_eos": True}):
        texts.append(chunk.choices[0].text)
        reasons.append(chunk.choices[0].finish_reason)
    assert reasons[-1] == "length" and sum(1 for t in texts if t) > 1


def test_client_that_leaves_is_withdrawn_and_its_row_stops(stack):
    """Close the stream after the first text: the gateway withdraws the request, the worker drops
    the row at its next step (the stream never gets an end), the log DB says cancelled."""
    client = _client(stack)
    n = 1500
    stream = client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=n, stream=True,
                                            extra_body={"ignore_eos": True})
    request_id = None
    for chunk in stream:
        request_id = chunk.id.removeprefix("chatcmpl-")
        if chunk.choices and chunk.choices[0].delta.content:
            break
    stream.close()
    assert request_id

    deadline = time.time() + 60
    while time.time() < deadline and (stack.redis.hlen(bus.pool_keys("default").inflight) or not stack.redis.exists(
            bus.cancel_key(request_id))):
        time.sleep(0.1)
    assert stack.redis.exists(bus.cancel_key(request_id))
    assert stack.redis.hlen(bus.pool_keys("default").inflight) == 0, "the batch should end once its only row is dropped"
    events = [StreamEvent.from_json(f[bus.STREAM_FIELD]) for _, f in stack.redis.xrange(bus.stream_key(request_id))]
    assert not any(e.final for e in events)
    generated = max((e.tokens for e in events), default=0)
    print(f"cancelled after {generated} of {n} tokens")
    assert generated < n
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT status FROM requests WHERE id = ?", (request_id,)).fetchone() == ("cancelled",)
    assert 'cohort_requests_cancelled_total{endpoint="chat",reason="disconnect"} 1.0' in \
        httpx.get(f"{stack.url}/metrics").text


def test_non_streaming_client_that_gives_up_is_withdrawn(stack):
    """A non-streaming client that times out and closes its connection: the gateway notices
    between its read slices and withdraws the request."""
    before = set(stack.redis.scan_iter(bus.cancel_key("*")))
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{stack.url}/v1/generate", json={"input": "a long one", "max_tokens": 1500,
                                                      "emulated_tokens": 1500}, timeout=1.5)
    deadline = time.time() + 30
    while time.time() < deadline and not (set(stack.redis.scan_iter(bus.cancel_key("*"))) - before):
        time.sleep(0.1)
    (key,) = set(stack.redis.scan_iter(bus.cancel_key("*"))) - before
    request_id = key.removeprefix(bus.cancel_key(""))
    while time.time() < deadline and stack.redis.hlen(bus.pool_keys("default").inflight):
        time.sleep(0.1)
    con = sqlite3.connect(stack.db_path)
    assert con.execute("SELECT status FROM requests WHERE id = ?", (request_id,)).fetchone() == ("cancelled",)
    events = [StreamEvent.from_json(f[bus.STREAM_FIELD]) for _, f in stack.redis.xrange(bus.stream_key(request_id))]
    assert not any(e.final for e in events) and max((e.tokens for e in events), default=0) < 1500


def test_generated_tokens_add_up_over_a_run_with_cancellations(stack):
    """Runs last in this module: every request so far (answered, cancelled while streaming, given up
    while waiting) is a stream whose last event says how many tokens its row generated. The
    counter the workers keep must equal their sum: tokens count when generated, whatever became
    of the request."""
    deadline = time.time() + 60
    keys = bus.pool_keys("default")
    while time.time() < deadline and (stack.redis.hlen(keys.inflight) or stack.redis.hlen(keys.pending)):
        time.sleep(0.1)
    per_request = {}
    for key in stack.redis.scan_iter(bus.stream_key("*")):
        events = [StreamEvent.from_json(f[bus.STREAM_FIELD]) for _, f in stack.redis.xrange(key)]
        per_request[key] = max((e.tokens for e in events), default=0)
    cancelled = sum(1 for key in stack.redis.scan_iter(bus.cancel_key("*")))
    assert cancelled >= 2 and len(per_request) >= 5
    samples = {s.name: s.value for fam in text_string_to_metric_families(httpx.get(f"{stack.url}/metrics").text)
               for s in fam.samples}
    assert samples["cohort_generated_tokens_total"] == sum(per_request.values())
