"""`cohort bench sim` end to end on tiny data: JSON shape, sweeps, plots, the ratio table."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from bench.cli import app
from bench.metrics import METRICS


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_sim_writes_json_table_and_plots(tiny_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the row cache goes to ./var/bench/cache
    out = tmp_path / "r.json"
    args = ["sim", "--policies", "vs,magnus,magnus+oracle,s3,slo-odbs", "--rate", "5,20", "--requests", "400",
            "--instances", "2", "--seed", "1", "--json", str(out), "--plot", str(tmp_path / "plots")]
    for f in tiny_files:
        args += ["--data", f]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert "thr/vs@elastic" in r.output and "magnus+oracle@elastic" in r.output
    assert "thr/cb" in r.output and "thr/bound" in r.output and "WT" in r.output   # vLLM baseline, bound, eq. 5
    d = json.loads(out.read_text())
    assert set(d) == {"config", "policies", "by_rate"}
    assert set(d["policies"]) == {"cb-fcfs", "vs@elastic", "magnus@elastic", "magnus+oracle@elastic",
                                  "s3@elastic", "slo-odbs@elastic"}   # cb-fcfs: added on the roofline
    for m in d["policies"].values():
        assert 0 < m["request_throughput"] <= m["physical_bound_rps"] * 1.001
    assert d["config"]["rate"] == 20.0 and set(d["by_rate"]) == {"5", "20"}
    for name, m in d["policies"].items():
        assert set(METRICS) <= set(m), name
        assert m["completed"] + m["failed"] == 400
    assert (tmp_path / "plots" / "throughput.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency.png").stat().st_size > 0
    # a single rate keeps the top-level shape only
    r = CliRunner().invoke(app, args[:5] + ["--rate", "5", "--requests", "50", "--json", str(out)]
                           + [a for f in tiny_files for a in ("--data", f)])
    assert r.exit_code == 0, r.output
    assert set(json.loads(out.read_text())) == {"config", "policies"}


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_sim_compares_execution_modes_in_one_run(tiny_files, tmp_path, monkeypatch):
    """--execution static,elastic runs every name under both; a name may carry its own mode."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "e.json"
    args = ["sim", "--policies", "vs,magnus+oracle,magnus@elastic/split", "--execution", "static,elastic",
            "--rate", "20", "--requests", "300", "--instances", "2", "--json", str(out),
            "--versus", "magnus+oracle@static", "--plot", str(tmp_path / "p")]
    for f in tiny_files:
        args += ["--data", f]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert list(d["policies"]) == ["cb-fcfs", "vs@static", "vs@elastic", "magnus+oracle@static", "magnus+oracle@elastic",
                                   "magnus@elastic/split"]
    assert d["config"]["sim"]["magnus@elastic/split"]["oom_recovery"] == "split"
    assert d["config"]["sim"]["vs@elastic"]["oom_recovery"] == "preempt"
    assert d["config"]["sim"]["vs@static"]["oom_recovery"] == "split"
    assert "thr/magnus+oracle@static" in r.output
    assert (tmp_path / "p" / "compare.png").stat().st_size > 0
    bad = CliRunner().invoke(app, ["sim", "--policies", "vs@fast", "--data", tiny_files[0]])
    assert bad.exit_code != 0
