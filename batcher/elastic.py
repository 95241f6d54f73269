"""Elastic execution's token arithmetic and eviction order, shared by the worker, the policies and the simulator.

Under elastic execution a finished row leaves its batch at once (its KV rows are dropped), so a
batch's KV use is a profile over decode steps, not β·(L(B)+G(B)): with the rows' lengths sorted
g_(1) ≥ g_(2) ≥ … the cache at step t holds (L(B)+t) tokens for each row still alive, and the
peak over t is max_k k·(L(B)+g_(k)) (just before the k-th longest row leaves).

When the next step would not fit, the worker evicts rows and hands them back as continuations;
``eviction_order`` is the one rule for which rows go first.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def peak_and_rank(input_len: int, gen_lens: Iterable[int]) -> tuple[int, int]:
    """(max_k k·(L + g_(k)), the smallest k reaching it): the peak and where it occurs (the
    incremental planner ``batcher.memory.KVPlan`` keeps both)."""
    peak, at = 0, 0
    for k, g in enumerate(sorted(gen_lens, reverse=True), start=1):
        v = k * (input_len + g)
        if v > peak:
            peak, at = v, k
    return peak, at


def peak_kv_tokens(input_len: int, gen_lens: Iterable[int]) -> int:
    """Peak KV tokens of a batch whose rows leave as they finish: max_k k·(L + g_(k))."""
    return peak_and_rank(input_len, gen_lens)[0]


def static_kv_tokens(input_len: int, gen_lens: Sequence[int]) -> int:
    """KV tokens of a static batch that keeps every row until its longest ends: β·(L + G(B))."""
    return len(gen_lens) * (input_len + max(gen_lens, default=0))


def batch_kv_tokens(input_len: int, gen_lens: Sequence[int], elastic: bool) -> int:
    """The KV tokens a batch needs at its peak under the given execution mode."""
    return peak_kv_tokens(input_len, gen_lens) if elastic else static_kv_tokens(input_len, gen_lens)


def next_step_kv_tokens(alive_rows: int, cache_len: int) -> int:
    """KV tokens held after the next decode step: each alive row appends one to a cache of
    ``cache_len`` (prompt padded to L(B), plus the steps run so far)."""
    return alive_rows * (cache_len + 1)


def eviction_order(remaining: Sequence[int], preemptions: Sequence[int], max_preemptions: int) -> list[int]:
    """Row indices in the order to evict them when memory runs short.

    Largest predicted remaining length first: it holds memory longest and frees the most for the
    rows that are about to finish. Rows already preempted ``max_preemptions`` times go last so
    every request keeps making progress; ties evict the later row (the earlier one was admitted
    first).
    """
    def key(i: int) -> tuple[bool, int, int]:
        return (preemptions[i] < max_preemptions, remaining[i], i)

    return sorted(range(len(remaining)), key=key, reverse=True)


def rows_kv_peak(contexts: Sequence[int], remaining: Sequence[int]) -> int:
    """Peak KV tokens of rows that each hold their own context (no padding) and leave after their
    remaining planned tokens: max over t of Σ_{rows alive at t} (c_i + t), reached just before a
    row leaves, i.e. max_k Σ_{j≤k} c_(j) + k·r_(k) with rows sorted by remaining r descending.
    With every c_i = L it is ``peak_kv_tokens(L, remaining)``: the same rule for a continuous
    engine's running set plus an admission group, whose prompts differ."""
    peak, ctx = 0, 0
    for k, (r, c) in enumerate(sorted(zip(remaining, contexts, strict=True), reverse=True), start=1):
        ctx += c
        v = ctx + k * r
        if v > peak:
            peak = v
    return peak


def admission_kv_tokens(contexts: Sequence[int], remaining: Sequence[int], page_tokens: int) -> int:
    """The KV a continuous instance plans for its running rows plus a joining group (each row's
    context and planned remaining tokens): their peak (``rows_kv_peak``) plus half a page per row
    for the partly filled last page. Half, not the worst case of a page less one token: fills are
    spread evenly, so the sum over dozens of rows stays close to it, and the worst case reserved
    18 % of a 4,096-token Θ at 50 rows and cost 6 % throughput in the simulator (docs/notes/benchmarks.md).
    What ``batcher.kv_judge.KVJudge.running_set_fits`` holds against the capacity."""
    return rows_kv_peak(contexts, remaining) + (page_tokens // 2) * len(contexts)
