"""The upstream benchmark's arithmetic: what it calls the engine's capacity, and the per-request
record that paired comparisons read."""

from __future__ import annotations

import math

import numpy as np

from bench.upstream_bench import StreamResult, per_request, saturated_rps


def _result(sent, first, done) -> StreamResult:
    n = len(sent)
    return StreamResult(np.array(sent, float), np.array(first, float), np.array(done, float),
                        np.full(n, 10), np.zeros(n), ~np.isnan(np.array(done, float)), max(done), {})


def test_a_burst_counts_the_rate_while_requests_waited_not_the_drain():
    # 100 requests at t=0 on an engine that finishes 10/s while 40 still wait (first tokens up to
    # t=6), then drains the last few long rows slowly until t=30
    n = 100
    done = [0.5 + i * 0.1 for i in range(90)] + [10 + 2 * i for i in range(10)]
    first = [min(6.0, i * 0.07) for i in range(n)]
    res = _result([0.0] * n, first, done)
    assert res.ok.sum() / max(done) < 4  # done/span: the drain pulls it under 4 req/s
    assert math.isclose(saturated_rps(res), 10.0, rel_tol=0.05)


def test_where_nothing_waited_the_rate_is_done_over_span():
    # every request started before the first finished: no queue, no window to measure in
    n = 50
    res = _result([i * 0.01 for i in range(n)], [0.1 + i * 0.01 for i in range(n)], [2 + i * 0.1 for i in range(n)])
    assert math.isclose(saturated_rps(res), n / res.done.max())


def test_lost_requests_are_left_out_and_too_few_give_zero():
    res = _result([0.0, 0.0], [0.1, math.nan], [1.0, math.nan])
    assert saturated_rps(res) == 0.0
    rows = per_request(res)
    assert rows["first"] == [0.1, None] and rows["done"] == [1.0, None] and rows["tokens"] == [10, 10]
