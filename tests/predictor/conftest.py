"""Fixtures for predictor tests: isolated settings (tmp data dir + SQLite log DB) and small real data."""

from __future__ import annotations

import os

import pytest

from cohort.settings import Settings


@pytest.fixture
def settings(tmp_path) -> Settings:
    return Settings(_env_file=None, data_dir=tmp_path / "var", database_url=f"sqlite:///{tmp_path}/log.db",
                    admin_token="s3cret", cold_start="max_tokens")


@pytest.fixture(scope="session")
def data_paths():
    """Paths of a few shared data files. Outside CI a missing ../shared/data skips; under CI=true
    ``shared_data_dir`` raises, so the test fails loudly."""
    from cohort.datasets import data_files, shared_data_dir

    d = shared_data_dir()
    if not d.is_dir():
        if os.environ.get("CI"):
            raise FileNotFoundError(d)
        pytest.skip(f"shared data {d} not present")
    return data_files(["mt_zh_en", "td", "ct_java_cs"])


@pytest.fixture(scope="session")
def small_items(data_paths):
    """(train_items, train_y, val_items, val_y) from a few rows per file."""
    from cohort.datasets import load_split
    from predictor.data import records_to_items

    tr_items, tr_y = records_to_items(load_split(data_paths, "train", limit_per_file=16))
    va_items, va_y = records_to_items(load_split(data_paths, "val", limit_per_file=8))
    return tr_items, tr_y, va_items, va_y


@pytest.fixture(scope="session")
def emb_cache(tmp_path_factory):
    """One embedding cache for the whole session: each text is encoded once."""
    return tmp_path_factory.mktemp("emb")
