import json
import os

import pytest

from predictor.baselines import MeanPredictor
from predictor.registry import Registry, UnknownVersion


def _add(reg: Registry, mean: float) -> str:
    version, staging = reg.new_dir()
    MeanPredictor(mean).save(staging, meta={"metrics": {"mae": mean}})
    reg.commit(version, staging)
    return version


def test_versions_activate_rollback(tmp_path):
    reg = Registry(tmp_path, "predictor")
    assert reg.versions() == [] and reg.active() is None
    v1 = _add(reg, 10)
    v2 = _add(reg, 20)
    assert reg.versions() == [v1, v2]  # sortable names, oldest first
    assert reg.active() == v2
    meta = reg.meta(v2)
    assert meta["kind"] == "mean" and meta["version"] == v2 and "created" in meta
    reg.activate(v1)  # rollback
    assert reg.active() == v1
    assert MeanPredictor.load(reg.active_path()).mean == 10
    listing = reg.listing()
    assert listing["active"] == v1 and [v["active"] for v in listing["versions"]] == [True, False]
    with pytest.raises(UnknownVersion):
        reg.activate("v-nope")
    with pytest.raises(UnknownVersion):
        reg.activate("../etc")
    assert reg.active() == v1


def test_active_written_atomically(tmp_path, monkeypatch):
    reg = Registry(tmp_path, "estimator")
    v1 = _add(reg, 1)
    calls = []
    real = os.replace

    def spy(src, dst):
        calls.append((str(src), str(dst)))
        return real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    reg.activate(v1)
    assert any(dst.endswith("ACTIVE") and ".tmp" in src for src, dst in calls)
    # no temporary files left behind, staging dirs are hidden and not versions
    assert not [p for p in reg.root.iterdir() if p.name.endswith(".tmp")]
    _, staging = reg.new_dir()
    assert staging.name.startswith(".") and reg.versions() == [v1]


def test_register_dir_and_missing_active(tmp_path):
    src = tmp_path / "model"
    MeanPredictor(3).save(src)
    reg = Registry(tmp_path / "data", "predictor")
    v = reg.register_dir(src)
    assert reg.active() == v and json.loads((reg.path(v) / "meta.json").read_text())["kind"] == "mean"
    reg.active_file.write_text("v-gone\n")  # pointing at a deleted version = no active version
    assert reg.active() is None
    with pytest.raises(FileNotFoundError):
        reg.register_dir(tmp_path / "nothing")
