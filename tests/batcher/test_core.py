"""WMA, MEM, the insertion rule, HRRN, VS and OOM split against hand-computed cases."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from batcher.elastic import batch_kv_tokens, peak_kv_tokens
from batcher.kv_judge import grow_bounds
from batcher.memory import KVMemory, kv_bytes_per_token
from batcher.oom import UnsplittableBatch, split_batch
from batcher.policies import make_policy
from batcher.policies.wma import WMAPolicy
from batcher.wma import batch_wma, total_wma, wma_gen, wma_wait
from cohort.types import Batch
from tests.batcher.helpers import LinearTime, ctx, level, open_batches, pick_hrrn, queued, req


def literal_wma_wait(G_p: int, G_B: int, L_B: int) -> int:
    return sum(g + L_B for g in range(G_p + 1, G_B + 1))


def test_wma_gen_hand_computed():
    # p has 3 input tokens in a batch padded to 10, generates 5: 5 · 7 padding reads
    assert wma_gen(3, 5, 10) == 35
    assert wma_gen(10, 5, 10) == 0


def test_wma_wait_hand_computed():
    # G(p)=2, G(B)=4, L(B)=10: steps 3 and 4 read (3+10) + (4+10) = 27
    assert wma_wait(2, 4, 10) == 27
    assert wma_wait(4, 4, 10) == 0
    for G_p, G_B, L_B in itertools.product(range(0, 12), range(0, 12), range(0, 9)):
        if G_p <= G_B:
            assert wma_wait(G_p, G_B, L_B) == literal_wma_wait(G_p, G_B, L_B)


def test_batch_wma_is_max_over_members():
    # B = {(L=10,G=4), (L=3,G=2)}: L_B=10, G_B=4
    # p1: gen 4·0=0, wait 0 → 0 ; p2: gen 2·7=14, wait (3+10)+(4+10)=27 → 41
    assert batch_wma([(10, 4), (3, 2)]) == 41
    assert total_wma([(10, 4), (3, 2)]) == 41
    assert batch_wma([(7, 9)]) == 0  # a batch of one wastes nothing
    assert batch_wma([]) == 0


def test_closed_form_used_by_the_policy_matches_the_definition():
    """WMA_p = G_B·L_B + T(G_B) − (G_p·L_p + T(G_p)); the policy relies on it."""
    from batcher.policies.wma import _Open

    for members in ([(10, 4), (3, 2)], [(5, 50), (80, 3), (20, 20)], [(1, 1), (1, 300), (300, 1)]):
        b = Batch("b", [req(L, G) for L, G in members[:1]], 0.0)
        ob = _Open(b, members[0][0], members[0][1], members[0][1] * members[0][0] + members[0][1] * (members[0][1] + 1) // 2)
        for L, G in members[1:]:
            phi, L_B, G_B = ob.wma_with(L, G)
            b.requests.append(req(L, G))
            ob.L, ob.G = L_B, G_B
            ob.min_useful = min(ob.min_useful, G * L + G * (G + 1) // 2)
            assert phi == batch_wma([(r.input_tokens, r.predicted_tokens) for r in b.requests])


def test_mem_and_delta():
    # Llama-7B: 32 layers, 32 kv heads, head_dim 128, fp16 → 2·32·32·128·2 = 524288 bytes/token
    cfg = {"num_hidden_layers": 32, "num_attention_heads": 32, "hidden_size": 4096, "torch_dtype": "float16"}
    assert kv_bytes_per_token(cfg) == 524_288
    gqa = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 128}
    assert kv_bytes_per_token(gqa, dtype_bytes=4) == 2 * 4 * 2 * 32 * 4
    glm = {"num_layers": 28, "num_attention_heads": 32, "hidden_size": 4096, "kv_channels": 128,
           "multi_query_attention": True, "multi_query_group_num": 2, "torch_dtype": "float16"}
    assert kv_bytes_per_token(glm) == 2 * 28 * 2 * 128 * 2
    m = KVMemory(delta_bytes=100, theta_bytes=10_000)
    assert m.mem(4, 10, 15) == 4 * 25 * 100
    assert m.judge().fits(4, 10, 15) and not m.judge().fits(5, 10, 15)
    assert m.max_fixed_batch_size(max_input=30, max_gen=20) == 2  # 10000 // (50·100)


def test_insertion_joins_the_min_wma_batch_under_phi():
    p = WMAPolicy(ctx(), threshold=1000)
    a, b = req(10, 100), req(10, 10)
    p.add(a, 0)
    p.add(b, 0)  # joining a: WMA_wait = Σ_{11}^{100}(g+10) = 5895 ≥ Φ → new batch
    assert [x.size for x in open_batches(p)] == [1, 1]
    c = req(12, 11)  # joins b (WMA small), not a
    p.add(c, 0)
    sizes = {x.requests[0].id: x.size for x in open_batches(p)}
    assert sizes == {a.id: 1, b.id: 2}


def test_insertion_respects_theta():
    p = WMAPolicy(ctx(theta_tokens=100), threshold=1e12)
    for _ in range(5):
        p.add(req(10, 10), 0)  # each needs 20 tokens; 5 fit exactly
    p.add(req(10, 10), 0)
    assert [x.size for x in open_batches(p)] == [5, 1]


def test_insertion_never_mixes_models_but_mixes_sampling():
    """Sampling is applied per row by the worker (batch_key is the model only)."""
    p = WMAPolicy(ctx(), threshold=1e12)
    p.add(req(10, 10), 0)
    p.add(req(10, 10, temperature=0.7), 0)
    p.add(req(10, 10, model="other"), 0)
    p.add(req(10, 10), 0)
    assert sorted(x.size for x in open_batches(p)) == [1, 3]


def test_glp_caps_batch_size():
    p = level(make_policy("glp", ctx(), threshold=1e12, batch_size=3))
    for _ in range(7):
        p.add(req(10, 10), 0)
    assert [x.size for x in open_batches(p)] == [3, 3, 1]


def test_hrrn_prefers_short_batches_then_long_waiters():
    est = LinearTime()
    short = Batch("s", [req(10, 10, arrival=0.0)], 0.0)      # T_p = 0.03
    long_ = Batch("l", [req(100, 900, arrival=0.0)], 0.0)    # T_p = 1.01
    # same wait (5 s): short ratio (5+0.03)/0.03 ≈ 168 beats long (5+1.01)/1.01 ≈ 6
    assert [short, long_][pick_hrrn([short, long_], est, now=5.0)].id == "s"
    # a short batch that just arrived loses to a long one that waited 100 s: 1 vs ≈ 100
    fresh = Batch("f", [req(10, 10, arrival=100.0)], 100.0)
    assert [fresh, long_][pick_hrrn([fresh, long_], est, now=100.0)].id == "l"


def test_magnus_pops_by_hrrn_abp_by_age():
    m, a = level(make_policy("magnus", ctx(), threshold=10)), level(make_policy("abp", ctx(), threshold=10))
    for pol in (m, a):
        pol.add(req(100, 900, arrival=0.0), 0.0)
        pol.add(req(10, 10, arrival=5.0), 5.0)
    assert m.pop(6.0).input_len == 10
    assert a.pop(6.0).input_len == 100


def test_vs_is_fcfs_with_the_memory_safe_fixed_size():
    c = ctx(theta_tokens=1000, max_input=100, max_tokens=150)  # 1000 // 250 = 4
    p = level(make_policy("vs", c))
    rs = [req(5, 5, arrival=i) for i in range(10)]
    for r in rs:
        p.add(r, r.arrival)
    b1 = p.pop(10)
    assert [r.id for r in b1.requests] == [r.id for r in rs[:4]]
    assert p.pop(10).size == 4 and p.pop(10).size == 2 and p.pop(10) is None


def test_nothing_pops_from_an_empty_policy():
    for name in ("vs", "glp", "abp", "magnus"):
        assert level(make_policy(name, ctx(), threshold=100)).pop(0) is None


def test_requeued_batches_are_dispatched_whole():
    p = level(make_policy("magnus", ctx(), threshold=10))
    b = Batch("half", [req(10, 10, arrival=0.0), req(10, 10, arrival=0.0)], 0.0)
    p.requeue(b, 1.0)
    p.add(req(10, 10, arrival=1.0), 1.0)  # does not join the re-queued batch
    assert len(queued(p)) == 3
    got = p.pop(2.0)
    assert got.id == "half" and got.size == 2


@pytest.mark.parametrize("name", ["vs", "glp", "abp", "magnus", "s3", "s3-hrrn", "slo-dbs", "odbs", "slo-odbs"])
def test_a_requeued_batch_goes_first_on_a_tie_and_after_a_better_open_one(name):
    """One rule for every policy (``Policy.pop``): the re-queued batch runs unless the open one
    ranks strictly better under the policy's order; VS always runs re-queued batches first."""
    def first_pop(open_arrival: float, open_slo: float) -> bool:
        """Whether the re-queued batch pops before one open request of the same shape."""
        p = level(make_policy(name, ctx(), threshold=10))
        back = Batch("back", [req(10, 10, arrival=1.0, slo=50.0)], 1.0)
        p.requeue(back, 2.0)
        p.add(req(10, 10, arrival=open_arrival, slo=open_slo), 2.0)
        return p.pop(3.0) is back

    assert first_pop(1.0, 50.0)                        # same arrival and deadline: a tie
    assert first_pop(0.0, 10.0) == (name == "vs")     # older, earlier deadline, longer wait


@pytest.mark.parametrize("n,expect", [(2, (1, 1)), (7, (4, 3)), (8, (4, 4))])
def test_oom_split_into_equal_halves(n, expect):
    b = Batch("b", [req(10, 10) for _ in range(n)], 0.0, attempt=1, splits=0)
    x, y = split_batch(b)
    assert (x.size, y.size) == expect
    assert [r.id for r in x.requests + y.requests] == [r.id for r in b.requests]
    assert x.splits == y.splits == 1 and x.attempt == 1 and x.id != y.id != b.id


def test_oom_split_of_one_refuses():
    with pytest.raises(UnsplittableBatch, match="single request"):
        split_batch(Batch("b", [req(10, 10)], 0.0))


def brute_force_peak(input_len: int, gen_lens: list[int]) -> int:
    """KV tokens held at each decode step t: every row not yet finished holds L + t; the max over t."""
    return max(sum(input_len + t for g in gen_lens if g >= t) for t in range(1, max(gen_lens) + 1))


def test_peak_profile_rule_equals_a_brute_force_over_steps():
    rng = random.Random(0)
    for _ in range(500):
        L = rng.randint(0, 50)
        lens = [rng.randint(1, 60) for _ in range(rng.randint(1, 9))]
        assert peak_kv_tokens(L, lens) == brute_force_peak(L, lens)
        assert batch_kv_tokens(L, lens, elastic=True) == brute_force_peak(L, lens)
        assert batch_kv_tokens(L, lens, elastic=False) == len(lens) * (L + max(lens))


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_incremental_plan_and_vector_bounds_agree_with_the_rule():
    """KVPlan.fits_with (O(1) bounds, exact fallback) and grow_bounds never contradict the rule."""
    rng = random.Random(1)
    for _ in range(3000):
        elastic = rng.random() < 0.7
        mem = KVMemory(delta_bytes=2, theta_bytes=2 * rng.randint(50, 2500))
        plan, members = mem.judge().plan(elastic), []
        for _ in range(rng.randint(2, 10)):
            L, g = rng.randint(0, 60), rng.randint(1, 80)
            if members:
                L_B = max([m[0] for m in members] + [L])
                truth = mem.judge().batch_fits(L_B, [m[1] for m in members] + [g], elastic)
                assert plan.fits_with(L, g) == truth
                col = lambda x: np.array([x])  # noqa: E731
                sure, may = grow_bounds(mem.theta_tokens, elastic, col(plan.size), col(plan.L), col(plan.lens[-1]),
                                        col(plan.lens[0]), col(plan.peak), col(plan.k_peak), L, g,
                                        np.maximum, np.minimum)
                assert (truth or not sure[0]) and (may[0] or not truth)
            plan.add(L, g)
            members.append((L, g))
            assert plan.tokens() == batch_kv_tokens(max(m[0] for m in members), [m[1] for m in members], elastic)


def _elastic_ctx(elastic: bool):
    c = ctx(theta_tokens=400)
    c.elastic = elastic
    return c


@pytest.mark.parametrize("name", ["abp", "magnus", "s3", "s3-hrrn", "slo-odbs"])
def test_elastic_planning_admits_a_batch_static_planning_refuses(name):
    """One 100-token request and nine 5-token ones, L = 10: static MEM 10·110 = 1100 > 400, but the
    peak with rows leaving is max(1·110, 10·15) = 150 ≤ 400."""
    def load(p):
        p.add(req(10, 100, 0.0, slo=1000.0), 0.0)
        for i in range(9):
            p.add(req(10, 5, 0.1 * (i + 1), slo=1000.0), 0.1 * (i + 1))
        return p.pop(1.0)

    static = load(level(make_policy(name, _elastic_ctx(False), threshold=1e12)))
    elastic = load(level(make_policy(name, _elastic_ctx(True), threshold=1e12)))
    assert elastic.size == 10
    assert static.size < 10 and static.size * (10 + static.predicted_gen_len) <= 400


def test_memory_planning_uses_the_upper_quantile_grouping_the_point():
    """predicted_upper sizes the batch; WMA still groups on predicted_tokens."""
    p = WMAPolicy(ctx(theta_tokens=100), threshold=1e12)
    for _ in range(3):
        r = req(10, 10, 0.0)
        r.predicted_upper = 40        # 2·(10+40) = 100 fits, 3·50 does not
        p.add(r, 0.0)
    assert sorted(b.size for b in open_batches(p)) == [1, 2]
    assert open_batches(p)[0].predicted_gen_len == 10


def test_vs_keeps_worst_case_sizing_under_elastic():
    a = level(make_policy("vs", _elastic_ctx(False)))
    b = level(make_policy("vs", _elastic_ctx(True)))
    assert level(a).batch_size == level(b).batch_size == 400 // 200
