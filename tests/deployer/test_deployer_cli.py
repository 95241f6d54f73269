"""`cohort deploy plan` (the typer app the main CLI mounts)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from deployer.cli import app

runner = CliRunner()


@pytest.mark.slow  # 1.90 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_plan_yaml_json_keys(examples, tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--topology", str(examples / "thesis_4gpu.yaml"), "--model",
                              str(examples / "chatglm6b-shaped" / "config.json"), "--mode", "helr",
                              "--a1", "1", "--a2", "0.5", "--kv-reserve-gb", "18", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "predicted cost" in res.output and "even" in res.output and "balanced" in res.output
    doc = json.loads(out.read_text())
    assert list(doc) == ["mode", "devices", "layers_per_device", "device_map", "predicted_cost", "baselines"]
    assert doc["mode"] == "helr"
    assert sorted(doc["devices"]) == [0, 1, 2]
    assert sum(doc["layers_per_device"].values()) == 28
    assert set(doc["layers_per_device"]) == {str(d) for d in doc["devices"]}
    assert set(doc["baselines"]) == {"even", "balanced"}
    for b in doc["baselines"].values():
        assert set(b) == {"device_map", "predicted_cost"}
        assert isinstance(b["predicted_cost"], float)
    assert isinstance(doc["predicted_cost"], float)
    assert doc["predicted_cost"] < doc["baselines"]["even"]["predicted_cost"]
    assert doc["device_map"]["model.embed_tokens"] == doc["devices"][0]
    assert doc["device_map"]["lm_head"] == doc["devices"][-1]


def test_plan_topo_text_with_gpus_csv(examples, tmp_path):
    out = tmp_path / "plan.json"
    res = runner.invoke(app, ["plan", "--topology", str(examples / "thesis_4gpu_topo.txt"), "--gpus",
                              str(examples / "thesis_4gpu_gpus.csv"), "--model",
                              str(examples / "chatglm6b-shaped"), "--mode", "he", "--kv-reserve-gb", "20",
                              "--json", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads(out.read_text())
    assert doc["mode"] == "he" and len(doc["devices"]) == 4


def test_plan_infeasible_exits_with_message(examples):
    res = runner.invoke(app, ["plan", "--topology", str(examples / "thesis_4gpu.yaml"), "--model",
                              str(examples / "chatglm6b-shaped" / "config.json"), "--kv-reserve-gb", "23.4"])
    assert res.exit_code == 1
    assert "needs" in res.output and "usable" in res.output
