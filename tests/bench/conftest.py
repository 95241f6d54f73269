"""Small hermetic data for the bench tests: a few JSONL rows per task in a temp dir."""

from __future__ import annotations

import json
import os
import random

import pytest

from bench.workload import build_rows
from cohort.datasets import shared_data_dir


def _write(path, task, n, seed, out_words):
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            words = rng.randint(*out_words)
            f.write(json.dumps({"task": task, "instruction": f"Do {task}.",
                                "input": " ".join(f"w{rng.randint(0, 99)}" for _ in range(rng.randint(3, 30))),
                                "output": " ".join("tok" for _ in range(words)), "source": f"t#{i}"}) + "\n")


@pytest.fixture(scope="session")
def tiny_files(tmp_path_factory):
    """Two tasks: short outputs (2–12 words) and long ones (60–200 words)."""
    d = tmp_path_factory.mktemp("data")
    short, long_ = d / "short.jsonl", d / "long.jsonl"
    _write(short, "short", 60, 1, (2, 12))
    _write(long_, "long", 60, 2, (60, 200))
    return [str(short), str(long_)]


@pytest.fixture(scope="session")
def tiny_rows(tiny_files, tmp_path_factory):
    return build_rows(tiny_files, None, cache_dir=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="session")
def chat_files():
    """The default chat files of ../shared/data (``[]``: ``bench.chat_prefix.CHAT_TASKS``). Outside CI
    a missing directory skips; under CI=true it fails loudly (CI must have the data)."""
    d = shared_data_dir()
    if not d.is_dir():
        if os.environ.get("CI"):
            raise FileNotFoundError(d)
        pytest.skip(f"shared data {d} not present")
    return []
