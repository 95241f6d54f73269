"""The order instances take an upstream pool's groups in (``release_bus.hand_over``): the most urgent
client priority first, then the lowest rank, whatever order they were handed over in."""

from __future__ import annotations

import random

import fakeredis

from cohort.release_bus import group_payload, hand_over


def test_groups_are_taken_by_priority_then_rank_whatever_the_numbers_sign_or_size():
    r = fakeredis.FakeRedis(decode_responses=True)
    rng = random.Random(0)
    ranks = [0.0, -0.0001, 1e-9, -3.5, 2.0, 1.8e9 * 5 + 7, 1.8e9 * 5 + 8, -1e300, 1e300, 42.0, 41.999999]
    ranks += [rng.uniform(-1e6, 1e6) for _ in range(50)]
    groups = [(rng.choice([-2, 0, 0, 7]), rank, f"g{i}") for i, rank in enumerate(ranks)]
    for priority, rank, name in rng.sample(groups, len(groups)):
        pipe = r.pipeline()
        hand_over(pipe, "k", priority, rank, f'{{"id": "{name}"}}')
        pipe.execute()
    taken = []
    while (got := r.zpopmin("k")):
        taken.append(group_payload(got[0][0]))
    expected = [f'{{"id": "{name}"}}' for _, _, name in sorted(groups, key=lambda g: (g[0], g[1]))]
    assert taken == expected
