"""`cohort serve` starts a dead process again, within a budget."""

from __future__ import annotations

import os
import sys
import time

import pytest

from launch.supervisor import RestartBudget
from procstack.stack import Stack


def test_restart_budget_allows_a_few_restarts_per_window():
    b = RestartBudget(limit=2, window_s=10.0)
    assert b.allow("worker", 0.0) and b.allow("worker", 1.0)
    assert not b.allow("worker", 2.0)          # a third death within the window: give up
    assert b.allow("batcher", 2.0)             # budgets are per process
    assert b.allow("worker", 11.5)             # the window moved on


@pytest.mark.e2e  # spawns real processes (each imports the whole CLI)
def test_a_dead_process_is_started_again_with_its_arguments(tmp_path):
    stack = Stack({**os.environ}, "http://127.0.0.1:1", log_dir=tmp_path)
    first = stack.spawn("help", "--help")
    first.wait(timeout=60)
    assert stack.dead() == ["help"]
    again = stack.restart("help")
    assert again.pid != first.pid and again.args == [sys.executable, "-m", "launch.cli", "--help"]
    again.wait(timeout=60)
    time.sleep(0.1)
    assert (tmp_path / "help.log").read_text().count("Usage") == 2
