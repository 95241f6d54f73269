"""The vectorised WMA assembly / HRRN pick behave exactly like the literal per-batch loop."""

from __future__ import annotations

import math
import random

import pytest

from batcher.policies import make_policy
from batcher.wma import batch_wma
from tests.batcher.helpers import ctx, level, open_batches, pick_hrrn, pick_oldest, req


def _reference_add(open_batches, r, threshold, memory, cap):
    """SPEC insertion rule over Batch objects with the literal WMA; returns the batch index or None."""
    best, best_phi = None, math.inf
    for i, b in enumerate(open_batches):
        if b.key != r.batch_key or (cap is not None and b.size >= cap):
            continue
        lengths = [(x.input_tokens, x.predicted_tokens) for x in b.requests] + [(r.input_tokens, r.predicted_tokens)]
        if not memory.judge().fits(len(lengths), max(L for L, _ in lengths), max(G for _, G in lengths)):
            continue
        phi = batch_wma(lengths)
        if phi < best_phi:
            best, best_phi = i, phi
    return best if best is not None and best_phi < threshold else None


@pytest.mark.parametrize("name", ["abp", "glp", "magnus"])
def test_vectorised_policy_matches_the_literal_rule(name):
    rng = random.Random(3)
    c = ctx(theta_tokens=2000)
    p = level(make_policy(name, c, threshold=3000.0, batch_size=4))
    cap = 4 if name == "glp" else None
    now = 0.0
    for step in range(400):
        now += rng.expovariate(2.0)
        if rng.random() < 0.8:
            r = req(rng.randint(1, 80), rng.randint(1, 150), arrival=now,
                    temperature=rng.choice([0.0, 0.0, 0.0, 0.7]))
            before = [list(b.requests) for b in open_batches(p)]
            j = _reference_add(open_batches(p), r, 3000.0, c.memory, cap)
            p.add(r, now)
            after = open_batches(p)
            if j is None:
                assert len(after) == len(before) + 1 and after[-1].requests == [r], step
            else:
                assert after[j].requests == before[j] + [r], step
        else:
            cands = list(p.closed) + open_batches(p)  # on a tie the re-queued batch goes first
            if not cands:
                continue
            i = pick_hrrn(cands, c.estimator, now) if name == "magnus" else pick_oldest(cands)
            expect = cands[i]
            got = p.pop(now)
            assert got is expect, step
            if rng.random() < 0.2 and got.size > 1:
                p.requeue(got, now)
