"""``workers.lm_head``: the LM head takes, per row count, the product layout timed faster at load,
computes what ``F.linear`` computes, keeps the model's weight (tied embeddings stay tied) and is
left alone where ``F.linear`` won everywhere."""

from __future__ import annotations

import torch
from torch import nn

from workers.lm_head import COLUMNS, LINEAR, MeasuredHead, measured_head, time_layouts


def head(vocab: int = 300, hidden: int = 16, bias: bool = False) -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(hidden, vocab, bias=bias)


def test_each_row_count_takes_the_layout_timed_faster_and_linear_above_the_ladder():
    timings = [(1, 2.0, 1.0), (2, 1.0, 2.0), (4, 3.0, 1.0)]
    h = measured_head(head(), timings)
    assert isinstance(h, MeasuredHead)
    assert [h.layout(n) for n in (1, 2, 3, 4, 5, 100)] == [COLUMNS, LINEAR, COLUMNS, COLUMNS, LINEAR, LINEAR]


def test_it_computes_what_linear_computes_for_any_shape_and_keeps_the_weight():
    for bias in (False, True):
        plain = head(bias=bias)
        h = measured_head(plain, [(n, 2.0, 1.0) for n in (1, 2, 4, 8)])  # columns everywhere on the ladder
        assert h.weight is plain.weight and h.bias is plain.bias
        for shape in ((1, 16), (3, 16), (1, 5, 16), (2, 4, 16), (1, 40, 16)):
            x = torch.randn(*shape)
            got = h(x)
            assert got.shape == (*shape[:-1], 300) and got.is_contiguous()
            torch.testing.assert_close(got, nn.functional.linear(x, plain.weight, plain.bias))


def test_linear_winning_everywhere_leaves_the_head_as_it_is():
    plain = head()
    assert measured_head(plain, [(1, 1.0, 2.0), (2, 1.0, 3.0)]) is plain
    assert measured_head(nn.Identity(), [(1, 2.0, 1.0)]).__class__ is nn.Identity


def test_timing_covers_the_ladder_within_its_budget():
    rows = time_layouts(head(), ladder=(1, 2, 4), reps=2)
    assert [n for n, _l, _c in rows] == [1, 2, 4] and all(lin > 0 and cols > 0 for _n, lin, cols in rows)
    assert len(time_layouts(head(), ladder=(1, 2, 4), reps=2, budget_s=0.0)) == 1  # the first is always timed


def test_the_built_in_cpu_model_keeps_tied_embeddings(shared_engine):
    model = shared_engine.model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
