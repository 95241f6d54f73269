"""Running-set tests on hand-built rows, no model (in the manner of vLLM's scheduler tests)."""

from batcher.kv_judge import pages_for
from batcher.running_set import RunningSet, RunRow


def test_pages_for_is_ceiling():
    assert [pages_for(n, 16) for n in (0, 1, 16, 17, 32)] == [0, 1, 1, 2, 2]


def test_group_admits_whole_or_not_at_all():
    book = RunningSet(num_pages=4, page_size=16)
    assert book.admit([RunRow("a", 30), RunRow("b", 20)])  # 2 + 2 pages
    assert book.free_tokens == 0
    assert not book.admit([RunRow("c", 1)])
    assert list(book.rows) == ["a", "b"]
    assert len(set(book.block_table("a")) | set(book.block_table("b"))) == 4


def test_prefill_chunks_under_budget_and_decode_goes_first():
    book = RunningSet(num_pages=100, page_size=16, token_budget=40)
    book.admit([RunRow("a", 10)])
    plan = book.plan_step()
    assert plan.prefill == [("a", 0, 10)] and plan.decode == []
    book.commit(plan)
    book.admit([RunRow("long", 100)])
    plan = book.plan_step()
    assert plan.decode == ["a"]
    assert plan.prefill == [("long", 0, 39)]  # budget 40 minus the decode token
    book.commit(plan)
    plan = book.plan_step()
    assert plan.prefill == [("long", 39, 39)]


def test_released_pages_let_the_next_group_join():
    book = RunningSet(num_pages=2, page_size=16)
    book.admit([RunRow("a", 16), RunRow("b", 16)])
    assert not book.admit([RunRow("c", 16)])
    book.release("a")
    assert book.admit([RunRow("c", 16)])


def test_decode_growth_evicts_by_eviction_order():
    book = RunningSet(num_pages=2, page_size=4, token_budget=100)
    book.admit([RunRow("short", 4, predicted_remaining=1), RunRow("long", 4, predicted_remaining=50)])
    book.commit(book.plan_step())  # both prefilled; each page full
    plan = book.plan_step()  # both need a second page; the pool is empty
    assert plan.evicted == ["long"]
    assert plan.decode == ["short"]
    assert len(book.block_table("short")) == 2


def test_row_at_max_preemptions_is_evicted_last():
    book = RunningSet(num_pages=2, page_size=4, max_preemptions=1)
    book.admit([RunRow("old", 4, predicted_remaining=1),
                RunRow("big", 4, predicted_remaining=50, preemptions=1)])
    book.commit(book.plan_step())
    plan = book.plan_step()
    assert plan.evicted == ["old"] and plan.decode == ["big"]


def test_row_cap_keeps_a_group_out_until_a_row_leaves():
    """``max_rows`` (COHORT_CONTINUOUS__MAX_ROWS) bounds the running set even with pages to spare;
    an empty book still takes a group of any size."""
    book = RunningSet(num_pages=100, page_size=16, max_rows=3)
    assert book.fits([(16, 4)] * 5)  # empty: the head of the queue always joins
    book.admit([RunRow("a", 16, planned_remaining=4), RunRow("b", 16, planned_remaining=4)])
    assert book.fits([(16, 4)])
    assert not book.fits([(16, 4), (16, 4)])
    book.release("a")
    assert book.fits([(16, 4), (16, 4)])
    assert not book.fits([(16, 4)] * 3)


def test_fits_plans_the_kv_peak_of_running_and_joining_rows():
    book = RunningSet(num_pages=8, page_size=16)  # 128 tokens
    book.admit([RunRow("a", 32, planned_remaining=32)])
    # both rows hold 32 tokens; with the joining one planned at r ≤ 32 more, the peak is just
    # before it leaves: 64 + 2r, plus half a page per row (16): r = 24 fills the 128 exactly
    assert book.fits([(32, 24)])
    assert not book.fits([(32, 25)])


class _LinearCost:
    def __init__(self, a: float, b: float) -> None:
        self.a, self.b = a, b
        self.seen: list[tuple[int, int, float]] = []

    def decode_seconds(self, rows: int, context_tokens: float) -> float:
        return self.a + self.b * rows

    def observe(self, decode_rows: int, prefill_tokens: int, kv_tokens: int, seconds: float) -> None:
        self.seen.append((decode_rows, prefill_tokens, kv_tokens, seconds))

    coefficients = None


def test_a_row_joins_only_while_it_pays_for_itself_on_the_steps():
    """COHORT_CONTINUOUS__MARGINAL_COST: with steps of 10 + rows seconds and a limit of 0.5 a row
    pays up to 10 rows (``batcher.row_cost.row_pays``), pages and the row cap to spare."""
    cost = _LinearCost(10.0, 1.0)
    book = RunningSet(num_pages=1000, page_size=16, marginal_cost=0.5, step_cost=cost)  # type: ignore[arg-type]
    book.admit([RunRow(f"r{i}", 16, planned_remaining=4) for i in range(9)])
    assert book.fits([(16, 4)])
    assert not book.fits([(16, 4), (16, 4)])
    book.release("r0")
    assert book.fits([(16, 4), (16, 4)])
    assert RunningSet(num_pages=1000, page_size=16, step_cost=cost).fits([(16, 4)] * 40)  # type: ignore[arg-type]


def test_the_book_teaches_its_step_cost_each_step():
    cost = _LinearCost(1.0, 0.0)
    book = RunningSet(num_pages=100, page_size=16, token_budget=40, marginal_cost=0.815,
                   step_cost=cost)  # type: ignore[arg-type]
    book.admit([RunRow("a", 10), RunRow("b", 50)])
    plan = book.plan_step()                    # a's whole prompt, then 30 of b's
    book.observe(plan, 0.25)
    assert cost.seen == [(0, 40, 10 + 30, 0.25)]
    book.commit(plan)
    book.commit(book.plan_step())              # a decodes its first token, b prefills its last 20
    plan = book.plan_step()                    # both decode, each attending to its own cache + the new token
    book.observe(plan, 0.1)
    assert cost.seen[-1] == (2, 0, (11 + 1) + (50 + 1), 0.1)


def test_a_book_with_the_rule_off_learns_nothing():
    """COHORT_CONTINUOUS__MARGINAL_COST 0 (or a CPU worker): the decode thread skips the fit."""
    cost = _LinearCost(1.0, 0.0)
    book = RunningSet(num_pages=100, page_size=16, token_budget=40, step_cost=cost)  # type: ignore[arg-type]
    book.admit([RunRow("a", 10)])
    book.observe(book.plan_step(), 0.25)
    assert cost.seen == []
