"""The bare streaming proxy of `cohort bench front` (its floor): the real OpenAI SDK gets through it
what it gets from the engine itself, streamed or not."""

from __future__ import annotations

import pytest
from openai import OpenAI

from bench.front_bench import fixed_delay_engines
from bench.front_cli import _proxy

pytestmark = pytest.mark.e2e


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)


def _streamed(url: str, tokens: int) -> tuple[str, list[str | None]]:
    stream = _client(url).completions.create(model="sim", prompt="Hello there", max_tokens=tokens, stream=True,
                                             extra_body={"ignore_eos": True})
    chunks = list(stream)
    return "".join(c.choices[0].text for c in chunks if c.choices), [c.choices[0].finish_reason for c in chunks
                                                                     if c.choices]


def test_the_proxy_streams_what_the_engine_streams(tmp_path):
    with fixed_delay_engines(1, 2.0, 1.0, tmp_path) as [(_, engine)], _proxy(engine, tmp_path / "proxy") as (url, roles):
        assert list(roles) == ["proxy"] and roles["proxy"][0].is_running()
        direct_text, direct_ends = _streamed(engine, 12)
        text, ends = _streamed(url, 12)
        assert text == direct_text and text
        assert ends[-1] == direct_ends[-1] == "length"
        whole = _client(url).completions.create(model="sim", prompt="Hello there", max_tokens=5)
        assert whole.choices[0].finish_reason == "length"
        assert whole.usage is not None and whole.usage.completion_tokens == 5
    assert not roles["proxy"][0].is_running()  # stopped with the block
