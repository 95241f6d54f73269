"""`cohort bench adaptive`: the grid's shape (issue 19's JSON keys), nothing lost, the plot."""

from __future__ import annotations

import pytest

from bench.adaptive import RUN_KEYS, plot_adaptive, run_adaptive, target_lines


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_grid_runs_every_policy_and_preemption_and_loses_nothing(tiny_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    res = run_adaptive(requests=80, max_outputs=(16, 64), datasets=("tiny",), gpu_pages=16, host_pages=8,
                       files={"tiny": tiny_files})
    runs = res["runs"]
    assert len(runs) == 2 * 2 * 3
    assert {(r["policy"], r["preemption"]) for r in runs} == {
        (p, m) for p in ("fcfs", "adaptive-fair") for m in ("recompute", "swap", "adaptive")}
    for r in runs:
        assert set(RUN_KEYS) <= set(r)
        assert r["completed"] == 80 and r["failed"] == 0
        assert r["weighted_turnaround"] >= 1.0
        if r["preemption"] == "recompute":
            assert r["swaps"] == 0
    assert any(r["swaps"] for r in runs) and any(r["recomputes"] for r in runs)   # 16 pages do starve it
    assert len(target_lines(runs)) == 4
    assert plot_adaptive(runs, tmp_path / "a.png").stat().st_size > 0
