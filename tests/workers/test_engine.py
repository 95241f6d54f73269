"""The engine on the built-in model: real HF generate on a left-padded batch."""

from __future__ import annotations

import pytest

from cohort.settings import Settings
from workers.engine import Engine, KVCacheOutOfMemory, RowSpec


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine(Settings(profile_on_start=False))


def test_delta_and_theta_come_from_the_model_and_budget(engine):
    cfg = engine.model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    assert engine.delta_bytes == 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    assert engine.theta_bytes == Settings().kv_budget_bytes


def test_emulated_lengths_are_exact_and_max_tokens_is_per_row(engine):
    rows = [RowSpec("Translate: good morning", 40, 3), RowSpec("Hi", 40, 17), RowSpec("x " * 30, 40, 0),
            RowSpec("no emulation here", 5)]
    out = engine.run(rows)
    assert out.generated_tokens[:3] == [3, 17, 0]
    assert out.generated_tokens[3] <= 5
    assert out.gen_len == 17  # the batch runs until its longest member is done
    assert out.input_len == max(engine.count_tokens([r.prompt for r in rows]))
    assert out.seconds > 0 and out.peak_mem_bytes == 4 * (out.input_len + out.gen_len) * engine.delta_bytes


def test_left_padding_does_not_change_a_requests_output(engine):
    short, long_ = RowSpec("short prompt", 12, 12), RowSpec("a much longer prompt " * 8, 12, 12)
    alone = engine.run([short]).texts[0]
    together = engine.run([long_, short]).texts[1]
    assert together == alone


def test_kv_budget_raises_the_oom_path(engine):
    small = Engine.__new__(Engine)
    small.__dict__.update(engine.__dict__)
    small.settings = Settings(kv_budget_bytes=50 * engine.delta_bytes, profile_on_start=False)
    with pytest.raises(KVCacheOutOfMemory, match="budget"):
        small.run([RowSpec("hello there", 60, 60)] * 2)
    assert small.run([RowSpec("hello", 10, 10)]).generated_tokens == [10]
    assert not small.fits(2, 10, 60) and small.fits(1, 10, 10)


def test_run_shape_times_exact_shapes(engine):
    assert engine.run_shape(2, 16, 8) > 0
