"""The simulated engine's scheduler against vLLM v1's rules: token budget, chunked prefill,
max_num_seqs, prefix hits by block hash, LRU eviction, preemption victims, priority order."""

from __future__ import annotations

from bench.engine_sim.request import Status
from bench.engine_sim.scheduler import PRIORITY, ScheduledRow, SimStep
from bench.engine_sim.step_time import StepShape
from tests.bench.engine_sim.helpers import make_req, make_sched, step


def test_token_budget_chunks_the_prompt_that_does_not_fit() -> None:
    s = make_sched(budget=150)
    a, b, c = make_req(100, name="a"), make_req(100, name="b"), make_req(100, name="c")
    for r in (a, b, c):
        s.add_request(r)
    assert step(s) == {"a": 100, "b": 50}          # b chunked, c waits
    assert a.num_output_tokens == 1 and b.num_output_tokens == 0
    assert step(s) == {"a": 1, "b": 50, "c": 99}    # running first (a decodes, b finishes its prompt)
    assert b.num_output_tokens == 1 and c.num_output_tokens == 0


def test_chunked_prefill_samples_only_after_the_last_chunk() -> None:
    s = make_sched(budget=128)
    r = make_req(300, max_tokens=3)
    s.add_request(r)
    assert [step(s)[r.request_id] for _ in range(3)] == [128, 128, 44]
    assert r.num_output_tokens == 1
    assert step(s) == {r.request_id: 1} and step(s) == {r.request_id: 1}
    assert r.status == Status.FINISHED and r.finish_reason == "length" and r.num_output_tokens == 3
    assert not s.has_work() and s.kv.usage == 0.0


def test_max_num_seqs_bounds_the_running_list() -> None:
    s = make_sched(max_num_seqs=2)
    reqs = [make_req(10) for _ in range(3)]
    for r in reqs:
        s.add_request(r)
    assert set(step(s)) == {reqs[0].request_id, reqs[1].request_id}
    assert len(s.running) == 2 and len(s.waiting) == 1


def test_max_model_len_caps_the_output() -> None:
    s = make_sched(max_model_len=40)
    r = make_req(36, max_tokens=100)
    s.add_request(r)
    while s.has_work():
        step(s)
    assert r.num_tokens == 40 and r.finish_reason == "length"


def test_prefix_hit_by_block_hash_counts_full_blocks_only() -> None:
    s = make_sched(block_size=16)
    shared = list(range(48))
    a = make_req(shared + [900 + i for i in range(10)], max_tokens=1)     # 58 tokens: 3 full blocks
    s.add_request(a)
    step(s)
    assert a.status == Status.FINISHED
    b = make_req(shared + [700 + i for i in range(20)], max_tokens=1)
    s.add_request(b)
    assert step(s) == {b.request_id: 68 - 48}
    assert b.num_cached_tokens == 48
    assert (s.kv.stats.queries, s.kv.stats.hits) == (58 + 68, 48)
    c = make_req(shared[:40] + [1, 2, 3, 4, 5, 6, 7, 8], max_tokens=1)  # diverges inside block 3
    s.add_request(c)
    step(s)
    assert c.num_cached_tokens == 32


def test_a_whole_cached_prompt_still_computes_its_last_token() -> None:
    s = make_sched(block_size=16)
    a = make_req(list(range(64)), max_tokens=1)
    s.add_request(a)
    step(s)
    b = make_req(list(range(64)), max_tokens=1)
    s.add_request(b)
    assert step(s) == {b.request_id: 16}   # capped at 63 tokens: 3 blocks hit, the 4th recomputed
    assert b.num_cached_tokens == 48


def test_freed_blocks_are_evicted_least_recent_first_and_a_request_tail_first() -> None:
    s = make_sched(num_blocks=1 + 6, block_size=4, max_model_len=24)
    a = make_req(list(range(16)), max_tokens=1)          # 4 full blocks; 2 stay free
    s.add_request(a)
    step(s)
    hashes = list(a.block_hashes[:4])
    assert all(s.kv.pool.get_cached(h) is not None for h in hashes)
    b = make_req([500 + i for i in range(16)], max_tokens=1)   # 4 blocks: the 2 free, then 2 evicted
    s.add_request(b)
    step(s)
    cached = [s.kv.pool.get_cached(h) is not None for h in hashes]
    assert cached == [True, True, False, False], cached   # a's last blocks went first
    assert s.kv.pool.evictions == 2


def test_shared_blocks_are_freed_by_their_last_holder() -> None:
    s = make_sched(block_size=4)
    a = make_req(list(range(9)), max_tokens=5)
    b = make_req(list(range(9)), max_tokens=5)
    s.add_request(a)
    step(s)
    s.add_request(b)
    step(s)
    shared = s.kv.blocks_of(a)[0]
    assert shared is s.kv.blocks_of(b)[0] and shared.ref_cnt == 2
    s.abort(a)
    assert shared.ref_cnt == 1 and a.status == Status.ABORTED
    s.abort(b)
    assert shared.ref_cnt == 0 and s.kv.usage == 0.0


def _pressure(policy: str, low_first: bool):
    """Two requests on 6 usable blocks of 4 tokens: each needs a fourth block at its 13th token."""
    s = make_sched(num_blocks=1 + 6, block_size=4, max_model_len=24, policy=policy)
    first = make_req(8, max_tokens=12, priority=5 if low_first else 0, name="first")
    second = make_req(8, max_tokens=12, priority=0, name="second")
    s.add_request(first)
    step(s)
    s.add_request(second)
    step(s)
    assert [r.request_id for r in s.running] == ["first", "second"]
    for _ in range(10):
        plan = s.schedule()
        if plan.preempted:
            return s, plan, first, second
        s.update(plan)
    raise AssertionError("no preemption")


def test_fcfs_preempts_the_last_running_request() -> None:
    s, plan, first, second = _pressure("fcfs", low_first=False)
    assert plan.preempted == [second]
    assert second.status == Status.PREEMPTED and second.num_computed_tokens == 0
    assert s.waiting.peek() is second and s.num_preemptions == 1
    assert [r.req for r in plan.rows] == [first]   # no admission in a step that preempted
    s.update(plan)
    while s.has_work():
        step(s)
    assert second.num_output_tokens == 12 and second.num_preemptions == 1   # resumed by recompute


def test_priority_preempts_the_lowest_priority_latest_even_when_it_is_not_last() -> None:
    s, plan, first, second = _pressure(PRIORITY, low_first=True)
    assert plan.preempted == [first]                # priority 5 is lower than 0, though it runs first
    assert plan.rows == []                          # it was its own victim: the step stops there (as vLLM's)
    s.update(plan)
    assert step(s) == {"second": 1} and s.waiting.peek() is first


def test_preempted_request_resumes_at_the_front_and_reuses_its_cached_blocks() -> None:
    s, plan, first, second = _pressure("fcfs", low_first=False)
    s.update(plan)
    before = s.kv.stats.preempted_queries
    while second.status != Status.RUNNING:
        step(s)
    assert s.kv.stats.preempted_queries > before   # counted apart from new requests' lookups
    assert s.kv.stats.queries == 16


def test_priority_waiting_queue_runs_lower_values_first_then_arrival() -> None:
    s = make_sched(max_num_seqs=1, policy=PRIORITY)
    reqs = [make_req(4, max_tokens=1, priority=p, name=f"p{p}-{i}") for i, p in enumerate((5, 1, 3, 1))]
    for r in reqs:
        s.add_request(r)
    order = []
    while s.has_work():
        order += list(step(s))
    assert order == ["p1-1", "p1-3", "p3-2", "p5-0"]


def test_abort_while_waiting_and_during_a_step() -> None:
    s = make_sched()
    a, b = make_req(20, max_tokens=4), make_req(20, max_tokens=4)
    s.add_request(a)
    s.add_request(b)
    s.abort(b)
    assert len(s.waiting) == 1 and b.status == Status.ABORTED
    plan = s.schedule()
    s.abort(a)                        # the client left while the step ran
    assert s.update(plan) == [] and s.kv.usage == 0.0


def test_step_shape_separates_prefill_from_decode() -> None:
    r1, r2 = make_req(10), make_req(30)
    r1.output_ids = [1, 2]
    plan = SimStep([ScheduledRow(r1, 1, 11), ScheduledRow(r2, 20, 10)])
    shape = StepShape.of(plan)
    assert (shape.decode_rows, shape.decode_context) == (1, 12)
    assert (shape.prefill_tokens, shape.prefill_context) == (20, 30)
    assert shape.prefill_pairs == 20 * (10 + 10)
