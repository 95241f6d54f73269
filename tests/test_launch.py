"""The entry points refuse a misspelt policy at start-up."""

from __future__ import annotations

import pytest
import typer

from cohort.settings import get_settings
from launch.cli import checked_settings


def test_an_unknown_policy_is_refused_at_start(monkeypatch):
    monkeypatch.setenv("COHORT_POLICY", "magnuss")
    get_settings.cache_clear()
    try:
        with pytest.raises(typer.BadParameter, match="magnuss"):
            checked_settings()
        monkeypatch.setenv("COHORT_POLICY", "s3-hrrn")
        get_settings.cache_clear()
        assert checked_settings().policy == "s3-hrrn"
    finally:
        get_settings.cache_clear()
