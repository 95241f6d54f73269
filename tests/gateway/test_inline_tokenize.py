"""The gateway tokenizes a short prompt on its event loop and a long one (or one whose tokenizer is
not loaded yet) on a thread; the ids are the same either way."""

from __future__ import annotations

import asyncio

import pytest

from cohort import tokenizer
from cohort.settings import DEFAULT_MODEL, Settings
from gateway import submit
from gateway.submit import INLINE_TOKENIZE_CHARS, Submission


@pytest.fixture
def hops(monkeypatch) -> list[str]:
    """The texts handed to a thread (every other call to the thread pool passes through)."""
    seen: list[str] = []
    real = submit.run_in_threadpool

    async def counting(fn, *args, **kw):
        if fn is submit.prompt_token_ids:
            seen.extend(args[0])
        return await real(fn, *args, **kw)

    monkeypatch.setattr(submit, "run_in_threadpool", counting)
    return seen


def _ids(text: str) -> list[int]:
    s = Settings()
    served = submit._default_model(s)
    return asyncio.run(submit._check(s, served, Submission(instruction="", user_input=text, max_tokens=4)))


def test_short_prompt_is_tokenized_inline_long_on_a_thread(hops):
    tokenizer.load_tokenizer(DEFAULT_MODEL)
    short = "translate this, please"
    long = "word " * (INLINE_TOKENIZE_CHARS // 5 + 1)
    assert _ids(short) == tokenizer.prompt_token_ids([short], DEFAULT_MODEL)[0]
    assert hops == []
    assert _ids(long) == tokenizer.prompt_token_ids([long], DEFAULT_MODEL)[0]
    assert hops == [long]


def test_a_tokenizer_not_loaded_yet_loads_on_a_thread(hops, monkeypatch):
    monkeypatch.setattr(tokenizer, "_loaded", set())
    assert not tokenizer.tokenizer_loaded(DEFAULT_MODEL)
    _ids("short")
    assert hops == ["short"]
    assert tokenizer.tokenizer_loaded(DEFAULT_MODEL)
