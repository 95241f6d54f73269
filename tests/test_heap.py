"""cohort.heap: what exists at the freeze is left out of the collector's passes, garbage included
only when the freeze does not collect first."""

from __future__ import annotations

import gc
import weakref

import pytest

from cohort.heap import freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture(autouse=True)
def _unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()  # the rest of the test run collects as usual


def _garbage_cycle() -> weakref.ref:
    return weakref.ref(_Node())  # nothing refers to the node but itself


@pytest.mark.slow  # 0.77 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_collecting_freeze_frees_startup_garbage_and_freezes_the_rest():
    gone = _garbage_cycle()
    kept = _Node()
    freeze_startup_heap()
    assert gone() is None  # collected before the freeze
    assert gc.get_freeze_count() > 0
    assert not any(o is kept for o in gc.get_objects())  # frozen objects are out of every generation


@pytest.mark.slow  # 0.63 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_freeze_without_collecting_keeps_garbage_out_of_reach_until_unfrozen():
    gone = _garbage_cycle()
    freeze_startup_heap(collect=False)
    gc.collect()
    assert gone() is not None  # frozen: full collections do not walk it
    gc.unfreeze()
    gc.collect()
    assert gone() is None


@pytest.mark.slow  # 0.54 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_objects_made_after_the_freeze_are_collected():
    freeze_startup_heap()
    later = _garbage_cycle()
    gc.collect()
    assert later() is None
