"""Background rows give way (batcher.row_priority) on hand-built rows, no model: which levels run
each step, how a yielding level's share rises as its priority closes on the urgent one, and how the
row book skips yielding rows and takes eviction victims from the least urgent level."""

import pytest

from batcher.row_priority import StepShares, least_urgent
from batcher.running_set import RunningSet, RunRow


def steps_run(shares: StepShares, levels: set[int], steps: int, level: int) -> int:
    return sum(level in shares.running(levels) for _ in range(steps))


def test_one_level_alone_runs_every_step():
    shares = StepShares(span=10, slowdown=0.0, min_duty=0.0)
    assert steps_run(shares, {10}, 50, 10) == 50


def test_the_most_urgent_level_always_runs_and_a_far_one_runs_min_duty():
    shares = StepShares(span=10, min_duty=0.1)
    runs = [shares.running({0, 10}) for _ in range(100)]
    assert all(0 in r for r in runs)
    assert sum(10 in r for r in runs) == 10
    # spread evenly: one step in ten, never two in a row
    assert [i for i, r in enumerate(runs) if 10 in r] == list(range(9, 100, 10))


def test_min_duty_zero_holds_background_rows_entirely():
    shares = StepShares(span=10, slowdown=0.0, min_duty=0.0)
    assert steps_run(shares, {0, 10}, 200, 10) == 0
    assert steps_run(shares, {0, 25}, 200, 25) == 0


@pytest.mark.parametrize(("gap", "share"), [(0, 1.0), (2, 0.8), (5, 0.5), (9, 0.1), (10, 0.0), (40, 0.0)])
def test_share_rises_linearly_as_the_gap_closes(gap, share):
    shares = StepShares(span=10, slowdown=0.0, min_duty=0.0)
    assert shares.duty(gap) == pytest.approx(share)
    assert steps_run(shares, {0, gap}, 100, gap) == pytest.approx(100 * share, abs=1)


def test_relative_to_the_most_urgent_present():
    """Two background jobs: the younger yields to the urgent one once no interactive row is there."""
    shares = StepShares(span=10, slowdown=0.0, min_duty=0.0)
    assert shares.running({0, 4, 10}) == {0}
    assert shares.running({4, 10}) == {4}
    assert steps_run(shares, {4, 10}, 100, 10) == pytest.approx(100 * shares.duty(6), abs=1)


def test_a_level_that_leaves_forgets_its_credit():
    shares = StepShares(span=10, min_duty=0.5)
    assert shares.running({0, 10}) == {0}          # credit 0.5
    assert shares.running({10}) == {10}            # alone: runs; the credit is gone
    assert shares.running({0, 10}) == {0}          # starts afresh: 0.5 again, not 1.0
    assert shares.running(set()) == set()


def test_least_urgent_picks_the_highest_priority_number():
    assert sorted(least_urgent({"a": 0, "b": 10, "c": 10, "d": 3})) == ["b", "c"]
    assert least_urgent({}) == []


def test_skipped_rows_keep_their_pages_and_do_no_work():
    book = RunningSet(num_pages=20, page_size=4, token_budget=100)
    book.admit([RunRow("bg", 6, priority=10), RunRow("ia", 5, priority=0)])
    plan = book.plan_step(skip={"bg"})
    assert plan.prefill == [("ia", 0, 5)] and plan.decode == []
    book.commit(plan)
    assert book.rows["bg"].computed == 0 and len(book.block_table("bg")) == 2
    plan = book.plan_step(skip={"bg"})
    assert plan.decode == ["ia"] and plan.prefill == []
    book.commit(plan)
    plan = book.plan_step()  # no longer yielding: it prefills
    assert plan.prefill == [("bg", 0, 6)] and plan.decode == ["ia"]


def test_an_urgent_row_needing_a_page_evicts_a_background_row_not_an_urgent_one():
    book = RunningSet(num_pages=2, page_size=4, token_budget=100)
    # by predicted length alone the urgent row would be the victim (largest remaining first)
    book.admit([RunRow("urgent", 4, predicted_remaining=50, priority=0),
                RunRow("bg", 4, predicted_remaining=1, priority=10)])
    book.commit(book.plan_step())
    plan = book.plan_step(skip={"bg"})
    assert plan.evicted == ["bg"] and plan.victims["bg"] == ([1], 4)
    assert plan.decode == ["urgent"] and len(book.block_table("urgent")) == 2


def test_same_level_keeps_the_eviction_order():
    book = RunningSet(num_pages=2, page_size=4, token_budget=100)
    book.admit([RunRow("short", 4, predicted_remaining=1, priority=10),
                RunRow("long", 4, predicted_remaining=50, priority=10)])
    book.commit(book.plan_step())
    assert book.plan_step().evicted == ["long"]


def test_the_base_share_keeps_the_urgent_rows_within_the_slowdown_measured():
    shares = StepShares(span=10, slowdown=0.1)
    assert shares.base() == pytest.approx(0.1)  # nothing measured: a first guess
    shares.running({0, 10})
    shares.observe(0.010, {0})                    # urgent rows alone: 10 ms
    shares.observe(0.030, {0, 10})                # with the job's rows: 30 ms (a CPU)
    # share d with 10 + d * 20 ms = 11 ms: d = 0.05
    assert shares.base() == pytest.approx(0.05)
    runs = [shares.running({0, 10}) for _ in range(200)]
    mean_step = sum(0.030 if 10 in r else 0.010 for r in runs) / len(runs)
    assert mean_step == pytest.approx(0.011, rel=0.02)


def test_nearly_free_background_rows_run_every_step():
    shares = StepShares(span=10, slowdown=0.1)
    shares.running({0, 10})
    shares.observe(0.010, {0})
    shares.observe(0.0105, {0, 10})  # a GPU: a few more rows cost almost nothing
    assert shares.base() == 1.0 and steps_run(shares, {0, 10}, 20, 10) == 20


def test_min_duty_is_the_floor_and_the_gap_ramp_starts_from_the_measured_share():
    shares = StepShares(span=10, slowdown=0.1, min_duty=0.2)
    shares.running({0, 10})
    shares.observe(0.010, {0})
    shares.observe(0.110, {0, 10})  # measured share 0.01, below the floor
    assert shares.base() == pytest.approx(0.2)
    assert shares.duty(5) == pytest.approx(0.6)


def test_steps_without_the_urgent_level_or_with_one_level_say_nothing():
    shares = StepShares(span=10, slowdown=0.1)
    shares.running({10})
    shares.observe(0.5, {10})        # the job alone
    shares.running({0, 10})
    shares.observe(0.5, {10})        # the urgent rows were not resident (waiting for pages)
    assert shares.t_alone is None and shares.t_mixed is None
