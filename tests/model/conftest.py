"""One built-in model per test run (per xdist worker) for every worker test that needs one.

The engine tests used a module-scoped engine each: under ``make test-unit`` every test is a work
unit of its own, so a worker that ran a test of another file in between tore the module's engine
down and built it again (the tiny Llama, and the paged path's references with it) — some forty
tests paid that. The model serves both paths, the padded decode loop and the paged continuous
one (``workers.paged_attention``: outside a packed step the paged attention is plain SDPA), so
one engine is shared by them all.

A test may change the engine's settings (``tests/model/test_swap_cost.py``); ``engine`` puts
the defaults back, and forgets the recompute cost read under other settings, before each test.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from cohort.settings import Settings


def _default_settings() -> Settings:
    return Settings(profile_on_start=False)


@pytest.fixture(scope="session")
def shared_engine():
    from workers.engine import (
        LLMEngine,  # torch + transformers' model classes: only where a test needs a model
    )

    return LLMEngine(_default_settings())


@pytest.fixture
def engine(shared_engine) -> Iterator:
    shared_engine.settings = _default_settings()
    shared_engine.__dict__.pop("_fitted_cost", None)
    yield shared_engine
    shared_engine.settings = _default_settings()
    shared_engine.__dict__.pop("_fitted_cost", None)
