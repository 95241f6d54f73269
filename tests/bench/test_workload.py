"""Workloads: seeded determinism, Poisson arrivals at the asked rate, lengths and the SLO rule."""

from __future__ import annotations

import numpy as np
import pytest

from bench.roofline import instance
from bench.workload import WorkloadConfig, build_rows, make_workload

TM = instance().time_model()


def test_rows_are_the_validation_split_and_cached(tiny_files, tiny_rows, tmp_path):
    assert len(tiny_rows.records) == 24  # 20 % of 60 per file
    assert {r.task for r in tiny_rows.records} == {"short", "long"}
    assert (tiny_rows.output_tokens > 0).all() and (tiny_rows.input_tokens > 0).all()
    again = build_rows(tiny_files, None, cache_dir=tmp_path)
    cached = build_rows(tiny_files, None, cache_dir=tmp_path)   # second read comes from the .npz
    assert list(tmp_path.glob("rows-*.npz"))
    np.testing.assert_array_equal(again.input_tokens, cached.input_tokens)


def test_same_seed_same_workload_other_seed_differs(tiny_files, tiny_rows):
    cfg = WorkloadConfig(files=tiny_files, requests=500, rate=5.0, seed=11)
    a, b = make_workload(cfg, TM, tiny_rows), make_workload(cfg, TM, tiny_rows)
    for f in ("row", "arrival", "input_tokens", "true_tokens", "predicted_tokens", "slo_s"):
        np.testing.assert_array_equal(getattr(a, f), getattr(b, f))
    c = make_workload(WorkloadConfig(files=tiny_files, requests=500, rate=5.0, seed=12), TM, tiny_rows)
    assert not np.array_equal(a.arrival, c.arrival)


@pytest.mark.parametrize("rate", [0.5, 8.0, 120.0])
def test_poisson_arrivals_at_rate(tiny_files, tiny_rows, rate):
    n = 20_000
    w = make_workload(WorkloadConfig(files=tiny_files, requests=n, rate=rate, seed=3), TM, tiny_rows)
    gaps = np.diff(np.concatenate([[0.0], w.arrival]))
    assert (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1.0 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1.0 / rate, rel=0.05)   # exponential: std = mean
    counts = np.bincount((w.arrival * rate / 10).astype(int))[:-1]  # arrivals per 10/rate s window
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)  # Poisson: var = mean


def test_lengths_mix_oracle_and_slo_rule(tiny_files, tiny_rows):
    cfg = WorkloadConfig(files=tiny_files, requests=4000, rate=2.0, seed=0, max_tokens=100,
                         weights=[3.0, 1.0], slo_k_min=2.0, slo_k_max=4.0, slo_min_s=0.5)
    w = make_workload(cfg, TM, tiny_rows)
    assert w.true_tokens.max() <= 100 and w.true_tokens.min() >= 1   # capped at max_tokens
    np.testing.assert_array_equal(w.predicted_tokens, w.true_tokens)  # no predictor: oracle
    assert np.mean(np.array(w.task) == "short") == pytest.approx(0.75, abs=0.03)
    solo = TM.estimate_many(np.stack([np.ones(len(w)), w.input_tokens, w.true_tokens], axis=1))
    k = w.slo_s / solo
    assert ((k >= 2.0 - 1e-9) | (w.slo_s == 0.5)).all() and (k <= 4.0 + 1e-9).all()
    reqs = w.requests()
    assert reqs[5].deadline == pytest.approx(w.arrival[5] + w.slo_s[5])
    assert reqs[5].emulated_tokens == reqs[5].true_tokens == w.true_tokens[5]


def test_bad_config_is_rejected(tiny_files, tiny_rows):
    with pytest.raises(ValueError):
        make_workload(WorkloadConfig(files=tiny_files, rate=0.0), TM, tiny_rows)
    with pytest.raises(ValueError):
        make_workload(WorkloadConfig(files=tiny_files, weights=[1.0]), TM, tiny_rows)
