"""Recompute-cost predictor: loading profile samples, the model search, the fitted predictor."""

from __future__ import annotations

import json

import numpy as np
import pytest

from predictor.recompute_cost import (
    DEGREES,
    MODELS,
    RecomputeCostModel,
    load_cost_file,
    load_prefill_samples,
    mape,
    model_search,
    save_cost_file,
    search_table,
)


def _prefill_s(b: int, L: int) -> float:
    """A prefill-shaped cost: overhead, linear in tokens, quadratic attention per row."""
    return 2e-3 + 4e-6 * b * L + 1e-9 * b * L * L


def _write(path, noise, seed):
    rng = np.random.default_rng(seed)
    samples = [{"size": b, "input_len": L, "gen_len": g, "seconds": _prefill_s(b, L) * (1 + rng.normal(0, noise))}
               for b in (1, 2, 3, 4, 6, 8, 12, 16) for L in (16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
               for g in (1, 16)]
    path.write_text(json.dumps({"samples": samples}))
    return path


def test_samples_are_prefills_with_each_shapes_median(tmp_path):
    files = [_write(tmp_path / f"p{k}.json", 0.05, k) for k in range(3)]
    s = load_prefill_samples(files, layers=4, hidden=128, reduce="median")
    assert len(s) == 80                                   # gen_len 16 rows are not prefills; repeats merged
    assert set(s.x[:, 2]) == {4} and set(s.x[:, 3]) == {128}
    with pytest.raises(ValueError):
        load_prefill_samples(files, 4, 128, max_gen=0)


@pytest.mark.slow  # fits every model family of the paper's grid at every degree: seconds
def test_search_covers_the_papers_grid_and_finds_a_smooth_cost(tmp_path):
    s = load_prefill_samples([_write(tmp_path / "p.json", 0.0, 0)], layers=4, hidden=128)
    res = model_search(s, seed=0)
    assert len(res["table"]) == len(MODELS) * len(DEGREES)
    assert res["best"]["mape_pct"] == min(r["mape_pct"] for r in res["table"])
    assert res["best"]["mape_pct"] < 2.0                  # a noiseless polynomial cost is found
    assert res["paper_choice"]["model"] == "random_forest" and res["paper_choice"]["degree"] == 2
    assert "knn_batch_time_mape_pct" in res and "Magnus" in search_table(res)


def test_fitted_model_predicts_seconds(tmp_path):
    s = load_prefill_samples([_write(tmp_path / "p.json", 0.0, 0)], layers=4, hidden=128)
    m = RecomputeCostModel("linear", 3).fit(s)
    assert m.seconds(200, 4, 4, 128) == pytest.approx(_prefill_s(4, 200), rel=0.02)
    assert mape(np.array([1.0, 2.0]), np.array([1.1, 1.8])) == pytest.approx(10.0)


def _search_and_save(tmp_path, model="cohort/tiny-random-llama", device="cpu"):
    s = load_prefill_samples([_write(tmp_path / "p.json", 0.0, 0)], layers=4, hidden=128)
    res = model_search(s, seed=0, models=("linear", "random_forest"), degrees=(1, 2, 3))
    return save_cost_file(tmp_path / "cost.json", s, res, model, device), res


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_the_saved_pick_is_refitted_for_its_model_and_device_only(tmp_path):
    path, res = _search_and_save(tmp_path)
    cost = load_cost_file(path, "cohort/tiny-random-llama", "cpu")
    assert cost is not None and (cost.name, cost.degree) == (res["best"]["model"], res["best"]["degree"])
    assert cost.prefill_seconds(200, 4) == pytest.approx(_prefill_s(4, 200), rel=0.02)
    assert load_cost_file(path, "other/model", "cpu") is None           # profiled for another model
    assert load_cost_file(path, "cohort/tiny-random-llama", "cuda") is None
    assert load_cost_file(tmp_path / "missing.json", "cohort/tiny-random-llama", "cpu") is None
    (tmp_path / "bad.json").write_text("{not json")
    assert load_cost_file(tmp_path / "bad.json", "cohort/tiny-random-llama", "cpu") is None


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_recompute_beside_running_rows_costs_the_marginal_prefill(tmp_path):
    """Issue 19: a victim re-prefilled inside a packed step costs f(β+1, L) − f(β, L), which
    leaves out the step's fixed cost; alone it costs the whole prefill f(1, L)."""
    path, _ = _search_and_save(tmp_path)
    cost = load_cost_file(path, "cohort/tiny-random-llama", "cpu")
    marginal = cost.recompute_seconds(300, running_rows=4)
    assert marginal == pytest.approx(_prefill_s(5, 300) - _prefill_s(4, 300), rel=0.05)
    assert cost.recompute_seconds(300, running_rows=0) == pytest.approx(_prefill_s(1, 300), rel=0.02)
    assert marginal < cost.recompute_seconds(300, running_rows=0)   # the 2 ms step overhead is not the row's


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_a_step_shaped_pick_prices_the_marginal_on_the_best_smooth_family(tmp_path):
    """A forest's f is a step function of β: its f(β+1) − f(β) is 0 inside a leaf. Where the
    search picks one, the marginal comes from the best linear-family model of the same search."""
    s = load_prefill_samples([_write(tmp_path / "p.json", 0.0, 0)], layers=4, hidden=128)
    res = model_search(s, seed=0, models=("linear", "random_forest"), degrees=(1, 2, 3))
    res["best"] = next(r for r in res["table"] if (r["model"], r["degree"]) == ("random_forest", 2))
    cost = load_cost_file(save_cost_file(tmp_path / "c.json", s, res, "m", "cpu"), "m", "cpu")
    assert (cost.name, cost.degree) == ("random_forest", 2) and cost.marginal == ("linear", 3)
    assert cost.recompute_seconds(300, 4) == pytest.approx(_prefill_s(5, 300) - _prefill_s(4, 300), rel=0.05)
