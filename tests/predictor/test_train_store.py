"""The bounded training store: a recent window plus a reservoir, rewritten atomically."""

from __future__ import annotations

from collections import Counter

import numpy as np

from predictor.train_store import RESERVOIR_TAG, append_bounded, bound_rows, read_rows


def test_store_never_holds_more_than_window_plus_reservoir(tmp_path):
    path = tmp_path / "store.jsonl"
    for start in range(0, 1000, 37):
        n = append_bounded(path, [{"i": i} for i in range(start, start + 37)], recent=50, reservoir=30)
        assert n <= 80
    rows = read_rows(path)
    assert len(rows) == 80
    window = [r["i"] for r in rows if not r.get(RESERVOIR_TAG)]
    top = 37 * (1000 // 37 + 1)  # every batch was added in full
    assert window == list(range(top - 50, top))  # the newest rows, in order
    reservoir = [r["i"] for r in rows if r.get(RESERVOIR_TAG)]
    assert len(reservoir) == 30 and all(i < top - 50 for i in reservoir)


def test_reservoir_is_a_uniform_sample_of_the_old_rows():
    """Algorithm R: every old row has the same chance to be kept (checked over many seeds)."""
    hits: Counter[int] = Counter()
    for seed in range(400):
        rng = np.random.default_rng(seed)
        kept, seen = bound_rows([{"i": i} for i in range(110)], recent=10, reservoir=10, seen_old=0, rng=rng)
        assert seen == 100
        hits.update(r["i"] for r in kept if r.get(RESERVOIR_TAG))
    early = sum(hits[i] for i in range(50))
    late = sum(hits[i] for i in range(50, 100))
    assert abs(early - late) < 0.15 * (early + late)  # 4000 draws: both halves near 2000


def test_compacting_applies_lowered_bounds_and_leaves_a_bounded_file_alone(tmp_path):
    path = tmp_path / "s.jsonl"
    append_bounded(path, [{"i": i} for i in range(100)], recent=100, reservoir=100)
    mtime = path.stat().st_mtime_ns
    assert append_bounded(path, [], recent=100, reservoir=100) == 100
    assert path.stat().st_mtime_ns == mtime  # nothing to do: not rewritten
    assert append_bounded(path, [], recent=20, reservoir=5) == 25
    assert len(read_rows(path)) == 25
