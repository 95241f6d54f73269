"""The prefix cache in the running set's page pool, on hand-built rows (no model): full prompt
pages are reused once written, shared read-only with reference counts, kept after their rows
leave until the pool needs them (least recently released first), and a shared page counts once
in the KV plan."""

from __future__ import annotations

from batcher.page_pool import PagePool
from batcher.prefix_pages import page_hashes
from batcher.running_set import RunningSet, RunRow

PS = 4


def row(rid: str, ids: list[int], **kw) -> RunRow:
    return RunRow(rid, len(ids), hashes=page_hashes(ids, PS, "m"), planned_remaining=kw.pop("planned", 4), **kw)


def prefill_all(rs: RunningSet) -> None:
    while any(r.prefill_left for r in rs.rows.values()):
        rs.commit(rs.plan_step())


SYSTEM = list(range(100, 112))  # three full pages


def test_a_later_prompt_reuses_the_written_pages_and_prefills_only_the_rest():
    rs = RunningSet(num_pages=20, page_size=PS, token_budget=64)
    assert rs.admit([row("a", SYSTEM + [1, 2])])
    prefill_all(rs)
    assert rs.admit([row("b", SYSTEM + [7, 8, 9])])
    a, b = rs.rows["a"], rs.rows["b"]
    assert b.cached == 12 and b.computed == 12 and b.pages[:3] == a.pages[:3]
    assert rs.plan_step().prefill == [("b", 12, 3)]
    assert (rs.pool.queries, rs.pool.hits) == (14 + 15, 12)
    assert all(rs.pool.refs[p] == 2 for p in a.pages[:3])


def test_the_last_prompt_token_is_always_prefilled():
    rs = RunningSet(num_pages=20, page_size=PS, token_budget=64)
    rs.admit([row("a", SYSTEM)])
    prefill_all(rs)
    rs.admit([row("b", SYSTEM)])
    assert rs.rows["b"].cached == 8 and rs.plan_step().prefill == [("b", 8, 4)]


def test_pages_stay_cached_after_their_row_leaves_until_the_pool_needs_them():
    rs = RunningSet(num_pages=6, page_size=PS, token_budget=64)
    rs.admit([row("a", SYSTEM + [1])])
    prefill_all(rs)
    rs.release("a")
    assert rs.free_tokens == 6 * PS                 # cached pages count as free
    rs.admit([row("b", SYSTEM + [2])])
    assert rs.rows["b"].cached == 12                # reused after its writer left
    rs.release("b")
    rs.admit([row("c", list(range(500, 520)))])     # five pages: two cached ones are reclaimed, oldest first
    assert rs.pool.lookup(page_hashes(SYSTEM, PS, "m")) == []  # the chain's first page went: nothing matches


def test_other_choices_of_one_request_wait_for_the_first_and_then_share_its_pages():
    rs = RunningSet(num_pages=40, page_size=PS, token_budget=8)
    ids = SYSTEM + [5, 6]
    rs.add_group("g", [row("n0", ids), row("n1", ids), row("n2", ids)])
    assert rs.admit_waiting().groups == ["g"]
    plan = rs.plan_step()
    assert [p[0] for p in plan.prefill] == ["n0"]   # the others wait for pages n0 is writing
    rs.commit(plan)
    while rs.rows["n0"].prefill_left:
        rs.commit(rs.plan_step())
    plan = rs.plan_step()
    assert sorted(p[0] for p in plan.prefill) == ["n1", "n2"]
    assert all(start == 12 for _r, start, _n in plan.prefill)
    shared = rs.rows["n0"].pages[:3]
    assert rs.rows["n1"].pages[:3] == shared == rs.rows["n2"].pages[:3]
    assert all(rs.pool.refs[p] == 3 for p in shared)


def test_a_row_asking_for_prompt_logprobs_or_coming_back_from_swap_reuses_nothing():
    rs = RunningSet(num_pages=20, page_size=PS, token_budget=64)
    rs.admit([row("a", SYSTEM + [1])])
    prefill_all(rs)
    rs.admit([row("b", SYSTEM + [1], cacheable=False), row("c", SYSTEM + [1], swapped=True)])
    assert rs.rows["b"].cached == 0 and rs.rows["c"].cached == 0


def test_a_shared_prefix_counts_once_in_the_kv_plan():
    long = list(range(200, 240))   # ten pages
    rs = RunningSet(num_pages=30, page_size=PS, token_budget=64)
    rs.admit([row("a", long + [1], planned=2)])
    prefill_all(rs)
    rs.add_group("g", [row("b", long + [2], planned=2), row("c", long + [3], planned=2)])
    # counted in full the three rows need ~3 x 43 tokens of 120; sharing the 40-token prefix they fit
    assert rs.admit_waiting().groups == ["g"]
    off = RunningSet(num_pages=30, page_size=PS, token_budget=64, prefix_caching=False)
    off.admit([row("a", long + [1], planned=2)])
    prefill_all(off)
    off.add_group("g", [row("b", long + [2], planned=2), row("c", long + [3], planned=2)])
    assert off.admit_waiting().groups == []


def test_take_fails_whole_and_leaves_the_cache_as_it_was():
    pool = PagePool(4)
    pages = pool.take(2)
    assert pages is not None
    pool.cache(pages[0], 11)
    pool.give(pages)
    assert pool.available == 4 and pool.take(5) is None and pool.lookup([11]) == [pages[0]]
