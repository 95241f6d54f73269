"""Hand-built traces and a simple batch-time model for the simulator tests."""

from __future__ import annotations

import random

import numpy as np

from batcher.memory import KVMemory
from cohort.types import ProfiledRequest

# Θ = 3,000 tokens on 2 instances: a trace of ``under_predicted`` requests overflows it.
TIGHT = KVMemory(delta_bytes=1, theta_bytes=3000)
TIGHT_RUN = dict(instances=2, max_input_tokens=50, max_tokens_limit=250, params={"threshold": 1e9})


class StepTime:
    """T = 0.1 + G·(0.02 + 0.0001·β): per-step cost grows slowly with β (decode is memory-bound)."""

    def estimate(self, size, input_len, gen_len):
        return 0.1 + gen_len * (0.02 + 0.0001 * size)

    def estimate_many(self, shapes):
        return np.array([self.estimate(*s) for s in shapes])


def mk(i, L, G, pred=None, t=0.0, slo=100.0):
    return ProfiledRequest(id=f"q{i}", prompt="", input_tokens=L, predicted_tokens=G if pred is None else pred,
                           max_tokens=2048, arrival=t, slo_s=slo, true_tokens=G)


def bimodal(n, rate, seed=0, noise=0.0):
    """Half short (5–15 tokens), half long (150–250) requests, Poisson arrivals."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        G = rng.randint(5, 15) if rng.random() < 0.5 else rng.randint(150, 250)
        pred = max(1, round(G * (1 + rng.uniform(-noise, noise))))
        out.append(mk(i, rng.randint(10, 50), G, pred, t))
    return out


def under_predicted(n, seed, lo, hi):
    """``n`` requests 10 ms apart, L = 20, G in [100, 200] predicted as G·U[lo, hi]: run on ``TIGHT``
    they overflow memory."""
    rng = random.Random(seed)
    return [mk(i, 20, g := rng.randint(100, 200), pred=max(1, int(g * rng.uniform(lo, hi))), t=i * 0.01)
            for i in range(n)]
