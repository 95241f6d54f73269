"""No field silently ignored: every field the OpenAI endpoints accept is in README's parameter
table, and every documented field either changes what reaches the worker or the answer, or is
refused with a 400 naming it, or is documented as accepted without effect (``user``,
``metadata``). A new field the schemas accept fails here until it is documented and classified."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from gateway.schemas import ACCEPTED_UNUSED, UNSUPPORTED, ChatCompletionRequest, CompletionRequest
from tests.gateway.harness import MSG, gateway, sse_data, worker

README = Path(__file__).resolve().parents[2] / "docs" / "parameters.md"  # the table users read

# field -> (endpoint, value sent, what the queued request must show)
SAMPLING: dict[str, tuple[str, Any, Any]] = {
    "temperature": ("chat", 0.5, lambda r: r.sampling.temperature == 0.5),
    "top_p": ("chat", 0.5, lambda r: r.sampling.top_p == 0.5),
    "seed": ("chat", 7, lambda r: r.sampling.seed == 7),
    "stop": ("chat", ["xy"], lambda r: r.sampling.stop == ("xy",)),
    "presence_penalty": ("chat", 0.5, lambda r: r.sampling.presence_penalty == 0.5),
    "frequency_penalty": ("chat", 0.5, lambda r: r.sampling.frequency_penalty == 0.5),
    "logit_bias": ("chat", {"5": 1.0}, lambda r: r.sampling.logit_bias == ((5, 1.0),)),
    "top_k": ("chat", 5, lambda r: r.sampling.top_k == 5),
    "repetition_penalty": ("chat", 1.2, lambda r: r.sampling.repetition_penalty == 1.2),
    "ignore_eos": ("completions", True, lambda r: r.sampling.ignore_eos and r.predicted_tokens == r.max_tokens),
    "emulated_tokens": ("completions", 3, lambda r: r.emulated_tokens == 3 and r.max_tokens > 3),
    "max_tokens": ("completions", 7, lambda r: r.max_tokens == 7),
    "max_completion_tokens": ("chat", 7, lambda r: r.max_tokens == 7),
    "priority": ("chat", 3, lambda r: r.priority == 3),
    "slo_seconds": ("chat", 5.0, lambda r: r.slo_s == 5.0),
    "logprobs": ("completions", 2, lambda r: r.sampling.logprobs == 2),
    "prompt_logprobs": ("completions", 2, lambda r: r.sampling.prompt_logprobs == 2),
    "prompt": ("completions", "a distinctive prompt", lambda r: "a distinctive prompt" in r.prompt),
    "messages": ("chat", [{"role": "user", "content": "distinctive words"}], lambda r: "distinctive words" in r.prompt),
}
# Fields that shape the answer rather than the queued request: checked on the response below.
ANSWER = {"stream", "stream_options", "echo", "n", "best_of", "model", "top_logprobs"}
NO_EFFECT = {"user", "metadata"}  # documented as caller bookkeeping


def documented() -> set[str]:
    text = README.read_text()
    start = text.index("| field | endpoint | behaviour |")
    fields: set[str] = set()
    for line in text[start:text.index("\n\n", start)].splitlines()[2:]:
        fields |= set(re.findall(r"`([a-z_]+)[^`]*`", line.split("|")[1]))
    return fields


def accepted() -> set[str]:
    return set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields) | set(ACCEPTED_UNUSED)


def test_every_accepted_field_is_documented_and_classified():
    doc = documented()
    assert accepted() - doc == set(), "fields the schemas accept but README's table does not name"
    refused = {f for f in UNSUPPORTED if not any(f.startswith(d) for d in doc)}
    assert refused == set(), "refused fields README's table does not name"
    assert accepted() == set(SAMPLING) | ANSWER | NO_EFFECT, "classify every accepted field in this test"


def _post(tmp_path, path: str, body: dict, answer: list[str] | None = None, **settings):
    async def scenario():
        async with gateway(tmp_path, **settings) as (_, client, redis):
            w = asyncio.create_task(worker(redis, answer or ["ok"]))
            r = await client.post(path, json=body)
            req = await w
            return r, req

    return asyncio.run(scenario())


@pytest.mark.parametrize("field", sorted(SAMPLING))
def test_each_sampling_field_reaches_the_worker(tmp_path, field):
    endpoint, value, shows = SAMPLING[field]
    path, base = ("/v1/chat/completions", {"messages": MSG}) if endpoint == "chat" else \
        ("/v1/completions", {"prompt": "hi"})
    # emulated lengths are a benchmark feature: a server without COHORT_EMULATE_LENGTHS refuses them
    r, req = _post(tmp_path, path, {**base, field: value}, **({"emulate_lengths": True} if field == "emulated_tokens" else {}))
    assert r.status_code == 200, r.text
    assert shows(req), (field, req)


@pytest.mark.slow  # a quarter second or more of real work: `make test` runs it, the fast loop does not
def test_answer_shaping_fields_shape_the_answer(tmp_path):
    r, _ = _post(tmp_path, "/v1/completions", {"prompt": "hello there", "echo": True})
    assert r.json()["choices"][0]["text"] == "hello thereok"
    r, _ = _post(tmp_path, "/v1/chat/completions", {"messages": MSG, "stream": True,
                                                     "stream_options": {"include_usage": True}}, ["a", "b"])
    chunks = sse_data(r.text)
    assert r.headers["content-type"].startswith("text/event-stream") and chunks[-1] == "[DONE]"
    assert chunks[-2]["usage"]["completion_tokens"] == 2
    r, req = _post(tmp_path, "/v1/chat/completions", {"messages": MSG, "logprobs": True, "top_logprobs": 3})
    assert req.sampling.logprobs == 3
    r, _ = _post(tmp_path, "/v1/completions", {"prompt": "hi", "best_of": 1, "user": "u", "metadata": {"k": "v"}})
    assert r.status_code == 200

    async def two_choices():
        async with gateway(tmp_path) as (_, client, redis):
            workers = [asyncio.create_task(worker(redis, ["x"])) for _ in range(2)]
            r = await client.post("/v1/completions", json={"prompt": "hi", "n": 2, "best_of": 2})
            await asyncio.gather(*workers)
            missing = await client.post("/v1/completions", json={"prompt": "hi", "model": "no-such-model"})
            return r, missing

    r, missing = asyncio.run(two_choices())
    assert [c["index"] for c in r.json()["choices"]] == [0, 1]
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"
