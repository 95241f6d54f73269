"""`cohort predictor replay`: rows streamed through predict → complete → learn, windows + final."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner


@pytest.mark.data
@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_cli_replay_windows_final_and_plot(data_paths, tmp_path, monkeypatch):
    """Train on one task, replay another (a shift): the report has the issue's shape, and the
    online bound's coverage over the final rows is closer to 0.9 than the static table's."""
    from cohort import settings as settings_mod
    from predictor.cli import app

    monkeypatch.setenv("COHORT_DATA_DIR", str(tmp_path / "var"))
    settings_mod.get_settings.cache_clear()
    try:
        runner = CliRunner()
        td = [p for p in data_paths if p.name.startswith("td")]
        code = [p for p in data_paths if p.name.startswith("ct_java_cs")]
        r = runner.invoke(app, ["train", "--kind", "linear", "--data", str(td[0]), "--out", str(tmp_path / "lin"),
                                "--limit-per-file", "400"])
        assert r.exit_code == 0, r.output
        out, png = tmp_path / "replay.json", tmp_path / "replay.png"
        r = runner.invoke(app, ["replay", "--model", str(tmp_path / "lin"), "--data", str(code[0]),
                                "--limit-per-file", "600", "--window", "200", "--final", "300",
                                "--json", str(out), "--plot", str(png)])
        assert r.exit_code == 0, r.output
        res = json.loads(out.read_text())
        assert [w["rows"] for w in res["windows"]] == [200, 400, 600]
        assert set(res["final"]) >= {"tau", "mae", "q90_coverage", "static_q90_coverage"}
        assert res["final"]["n"] == 300 and png.is_file()
        assert res["segments"] == [{"source": "ct_java_cs", "first_row": 0}]
        assert all(w["model_tau"] is not None and w["upper_mean"] >= 1 for w in res["windows"])
        final = res["final"]
        assert abs(final["q90_coverage"] - 0.9) < abs(final["static_q90_coverage"] - 0.9)
        assert 0.8 <= final["q90_coverage"] <= 0.98
        assert not (tmp_path / "var" / "models").exists()  # a replay never touches the live online state
    finally:
        settings_mod.get_settings.cache_clear()


@pytest.mark.data
@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_cli_replay_of_interleaved_sources_reports_each_source(data_paths, tmp_path, monkeypatch):
    """``--shuffle``: two tasks' rows interleaved (mixed, unlabelled traffic). The report covers each
    source over the final rows and per window, the run says how many prompt clusters it used, and
    the plot draws one coverage line per source instead of a marker per source change."""
    from cohort import settings as settings_mod
    from predictor.cli import app

    monkeypatch.setenv("COHORT_DATA_DIR", str(tmp_path / "var"))
    monkeypatch.setenv("COHORT_ONLINE__CLUSTERS", "2")
    settings_mod.get_settings.cache_clear()
    try:
        runner = CliRunner()
        td = [p for p in data_paths if p.name.startswith("td")][0]
        code = [p for p in data_paths if p.name.startswith("ct_java_cs")][0]
        r = runner.invoke(app, ["train", "--kind", "linear", "--data", str(td), "--out", str(tmp_path / "lin"),
                                "--limit-per-file", "400"])
        assert r.exit_code == 0, r.output
        out, png = tmp_path / "mixed.json", tmp_path / "mixed.png"
        r = runner.invoke(app, ["replay", "--model", str(tmp_path / "lin"), "--data", str(td), "--data", str(code),
                                "--limit-per-file", "300", "--shuffle", "0", "--window", "200", "--final", "300",
                                "--json", str(out), "--plot", str(png)])
        assert r.exit_code == 0, r.output
        res = json.loads(out.read_text())
        assert res["shuffle"] == 0 and res["clusters"] == 2 and res["mixed"] and png.is_file()
        assert set(res["final_per_source"]) == {"td", "ct_java_cs"}
        assert sum(m["n"] for m in res["final_per_source"].values()) == 300
        assert all(set(w["q90_coverage_per_source"]) == {"td", "ct_java_cs"} for w in res["windows"])
    finally:
        settings_mod.get_settings.cache_clear()
