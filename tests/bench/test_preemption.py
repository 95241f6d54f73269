"""batcher.preemption: eq. 2's swap time and Algorithm 1's per-victim choice."""

from __future__ import annotations

import pytest

from batcher.preemption import SwapLink, choose_preemption, swap_seconds
from cohort.settings import Settings


def test_swap_seconds_is_bytes_over_bandwidth_out_and_back():
    link = SwapLink(to_host_bytes_per_s=1000.0, to_device_bytes_per_s=500.0)
    assert swap_seconds(10, 20, link) == pytest.approx(200 / 1000 + 200 / 500)
    assert swap_seconds(0, 20, link) == 0.0


def test_adaptive_swaps_only_when_cheaper_and_the_host_has_room():
    assert choose_preemption("adaptive", 1.0, 2.0, host_free_tokens=64, tokens=32) == "swap"
    assert choose_preemption("adaptive", 3.0, 2.0, host_free_tokens=64, tokens=32) == "recompute"
    assert choose_preemption("adaptive", 1.0, 2.0, host_free_tokens=16, tokens=32) == "recompute"


def test_fixed_modes():
    assert choose_preemption("recompute", 0.0, 9.0, 1000, 1) == "recompute"
    assert choose_preemption("swap", 9.0, 0.0, 1000, 1) == "swap"
    assert choose_preemption("swap", 9.0, 0.0, 0, 1) == "recompute"    # no room: nothing else to do
    with pytest.raises(ValueError):
        choose_preemption("both", 1.0, 2.0, 10, 1)   # type: ignore[arg-type]


def test_setting_defaults_to_recompute(monkeypatch):
    monkeypatch.delenv("COHORT_PREEMPTION", raising=False)
    assert Settings().preemption == "recompute"
    monkeypatch.setenv("COHORT_PREEMPTION", "adaptive")
    assert Settings().preemption == "adaptive"
