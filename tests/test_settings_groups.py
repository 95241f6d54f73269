"""Tuning knobs live in groups (``settings.continuous.max_rows`` from COHORT_CONTINUOUS__MAX_ROWS);
their old flat names still configure them, so a deployment's environment keeps working."""

from __future__ import annotations

import pytest

from cohort.settings import MOVED, Settings


def test_a_group_reads_its_nested_variables(monkeypatch):
    monkeypatch.setenv("COHORT_CONTINUOUS__MAX_ROWS", "7")
    monkeypatch.setenv("COHORT_ONLINE__WINDOW", "40")
    s = Settings(_env_file=None)
    assert s.continuous.max_rows == 7 and s.online.window == 40
    assert s.offline.priority == 10  # untouched knobs keep their defaults


def test_old_flat_names_still_work_and_the_group_name_wins(monkeypatch, caplog):
    monkeypatch.setenv("COHORT_CONTINUOUS_MAX_ROWS", "5")
    monkeypatch.setenv("COHORT_RETENTION_EVERY_S", "9")
    monkeypatch.setenv("COHORT_RETENTION__EVERY_S", "11")
    with caplog.at_level("WARNING", logger="cohort.settings"):
        s = Settings(_env_file=None)
    assert s.continuous.max_rows == 5
    assert s.retention.every_s == 11.0
    assert Settings(_env_file=None, learning_cpu_share=0.5).learning.cpu_share == 0.5


def test_every_moved_name_lands_in_a_field_of_its_group():
    s = Settings(_env_file=None)
    for old, (group, new) in MOVED.items():
        assert hasattr(getattr(s, group), new), old
        assert old not in Settings.model_fields


def test_a_bad_value_under_a_group_is_refused(monkeypatch):
    monkeypatch.setenv("COHORT_CONTINUOUS__MAX_ROWS", "0")
    with pytest.raises(ValueError, match="max_rows"):
        Settings(_env_file=None)
