"""``workers.sampling.draw``: inverse-CDF sampling draws each token with its softmax probability,
never one the processors ruled out, and is a pure function of its uniform number (so a seeded row
gives the same tokens wherever it runs)."""

from __future__ import annotations

import math

import torch

from cohort.types import SamplingParams
from workers.sampling import RowSampler, draw


def test_each_token_comes_up_with_its_probability():
    scores = torch.tensor([0.0, 1.0, 2.0, float("-inf"), 0.5])
    probs = torch.softmax(scores.double(), -1)
    gen = torch.Generator().manual_seed(0)
    n = 20_000
    counts = torch.zeros(len(scores))
    for _ in range(n):
        counts[draw(scores, torch.rand((), generator=gen, dtype=torch.float64))] += 1
    assert counts[3] == 0  # -inf: probability 0, never drawn
    for i in (0, 1, 2, 4):
        sd = math.sqrt(n * probs[i] * (1 - probs[i]))
        assert abs(counts[i] - n * probs[i]) < 5 * sd, (i, counts.tolist(), (n * probs).tolist())


def test_the_ends_of_the_unit_interval_land_on_tokens_that_can_occur():
    scores = torch.tensor([float("-inf"), 3.0, 1.0, float("-inf"), float("-inf")])
    assert draw(scores, torch.tensor(0.0, dtype=torch.float64)) == 1
    assert draw(scores, torch.tensor(1.0 - 2.0**-53, dtype=torch.float64)) == 2
    assert draw(scores, torch.tensor(1.0, dtype=torch.float64)) == 2  # past the end: the last possible token
    share = float(torch.softmax(scores.double(), -1)[1])
    assert draw(scores, torch.tensor(share - 1e-9, dtype=torch.float64)) == 1
    assert draw(scores, torch.tensor(share + 1e-9, dtype=torch.float64)) == 2


def test_a_seeded_row_draws_the_same_token_at_the_same_position():
    scores = torch.randn(1, 1000, generator=torch.Generator().manual_seed(1))
    a = RowSampler(SamplingParams(temperature=1.0, seed=11), prompt_len=3)
    b = RowSampler(SamplingParams(temperature=1.0, seed=11), prompt_len=3)
    picks = [a.choose(scores, pos) for pos in range(40)]
    assert picks == [b.choose(scores, pos) for pos in range(40)]
    assert len(set(picks)) > 10  # the position reseeds: not one token forty times
