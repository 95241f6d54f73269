"""S3-style policy: bucket sort + first-fit-decreasing under Θ, oldest request's bin first."""

from __future__ import annotations

from batcher.policies import make_policy
from batcher.policies.s3 import S3Policy, bucket_of
from tests.batcher.helpers import ctx, level, queued, req


def test_buckets_follow_the_power_of_two_edges():
    assert [bucket_of(x) for x in (0, 7, 8, 15, 16, 31, 32, 1023, 1024, 2047, 5000)] == \
        [0, 0, 1, 1, 2, 2, 3, 7, 8, 8, 8]


def test_ffd_packs_long_first_and_fills_gaps_under_theta():
    p = S3Policy(ctx(theta_tokens=100))
    a, b, c, d = req(10, 40), req(10, 5), req(10, 30), req(10, 6)
    # sorted decreasing: a(40) c(30) d(6) b(5)
    # a: bin0 [1,10,40]; c: 2·(10+40)=100 ≤ 100 → bin0; d: 3·50 > 100 → bin1; b: bin1 (2·(10+6)=32)
    bins = p.pack([a, b, c, d])
    assert [[r.id for r in x] for x in bins] == [[a.id, c.id], [d.id, b.id]]


def test_pop_dispatches_the_bin_of_the_oldest_request():
    p = level(make_policy("s3", ctx(theta_tokens=100)))
    old_short = req(10, 5, arrival=0.0)
    p.add(old_short, 0.0)
    for t in (1.0, 2.0):
        p.add(req(10, 40, arrival=t), t)
    p.add(req(10, 6, arrival=3.0), 3.0)
    first = p.pop(4.0)
    # the two long ones fill bin0; old_short packs with the 6-token one
    assert old_short in first.requests and first.size == 2
    assert all(r.predicted_tokens < 8 for r in first.requests)
    second = p.pop(5.0)
    assert second.size == 2 and second.predicted_gen_len == 40
    assert p.pop(6.0) is None


def test_never_mixes_keys_and_respects_theta():
    p = level(make_policy("s3", ctx(theta_tokens=60)))
    p.add(req(10, 10, arrival=0.0), 0.0)
    p.add(req(10, 10, arrival=0.5, model="other"), 0.5)
    for t in (1.0, 2.0, 3.0):
        p.add(req(10, 10, arrival=t), t)
    b = p.pop(4.0)
    assert len({r.batch_key for r in b.requests}) == 1
    assert b.size * (b.input_len + b.predicted_gen_len) <= 60  # Δ = 1
    assert b.size == 3
    sizes = []
    while (x := p.pop(5.0)) is not None:
        sizes.append(x.size)
    assert sorted(sizes) == [1, 1]


def test_requeued_batch_with_older_requests_goes_first():
    p = level(make_policy("s3", ctx()))
    p.add(req(10, 10, arrival=5.0), 5.0)
    p.add(req(10, 10, arrival=1.0), 5.0)  # arrives late in the queue but is older
    b = p.pop(6.0)
    p.add(req(10, 10, arrival=7.0), 7.0)
    p.requeue(b, 8.0)
    again = p.pop(9.0)
    assert again is b
    assert len(queued(p)) == 1


def test_window_limits_the_packing_to_the_oldest_requests():
    p = S3Policy(ctx(), window=2)
    rs = [req(10, 10, arrival=float(i)) for i in range(5)]
    for r in rs:
        p.add(r, r.arrival)
    b = p.pop(10.0)
    assert [r.id for r in b.requests] == [rs[0].id, rs[1].id]


def test_s3_hrrn_dispatches_the_highest_response_ratio_bin():
    # Θ = 100 tokens: the two long requests (50 tokens each) fill one bin, the short ones another
    p = level(make_policy("s3-hrrn", ctx(theta_tokens=100)))
    long1, long2 = req(10, 40, arrival=0.0), req(10, 40, arrival=0.0)
    short1, short2 = req(10, 5, arrival=1.0), req(10, 6, arrival=1.0)
    for r in (long1, long2, short1, short2):
        p.add(r, r.arrival)
    # LinearTime: T_p(long bin) = 0.01 + 0.001·2·50 = 0.11, T_p(short) = 0.01 + 0.001·2·16 = 0.042
    # at t=2: long (2+0.11)/0.11 ≈ 19.2 < short (1+0.042)/0.042 ≈ 24.8 → short bin first (oldest-first
    # s3 would send the long one)
    first = p.pop(2.0)
    assert {r.id for r in first.requests} == {short1.id, short2.id}
