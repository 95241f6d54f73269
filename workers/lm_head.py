"""The LM head on a CPU, its matrix product chosen per row count by timing it at load.

A decode step runs the LM head on a handful of rows (one per decoding row): a
``[rows, hidden] × [hidden, vocab]`` product whose cost is reading the vocab-wide weight. How fast
the CPU's BLAS does that depends on the machine and on the row count. On the 2-core AMD EPYC VM the
soaks run on, ``F.linear`` (MKL's GEMM with the weight transposed) took 4.7 ms for 2 rows and
8.0 ms for 3, while the same product laid out as ``weight @ x.T`` took 1.0 and 1.6 ms, on a tiny
Llama whose whole decode step is ~10 ms (docs/notes/steady.md). On another machine the order may be the
reverse. So the worker times both layouts on the model's own weight at load, for a ladder of row
counts, and uses the faster one for each; above the ladder (prefill with prompt logprobs) it keeps
``F.linear``. Both layouts compute the same sums; like any BLAS call their last bits already depend
on the row count, so greedy answers stay those of ``F.linear`` as far as batching ever let them.

The head keeps the model's weight ``Parameter`` (tied embeddings stay tied) and adds no copy of it.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch
from torch import nn

log = logging.getLogger(__name__)

ROW_LADDER = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
TIMING_BUDGET_S = 4.0  # row counts not timed within it keep F.linear (a big model's head is slow to time)
LINEAR, COLUMNS = "linear", "columns"


def _columns(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T`` computed as ``(weight @ x.T).T``, made contiguous for the sampler."""
    out = torch.mm(weight, x.T).T.contiguous()
    return out + bias if bias is not None else out


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return nn.functional.linear(x, weight, bias)


LAYOUTS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]] = {
    LINEAR: _linear, COLUMNS: _columns}


class MeasuredHead(nn.Module):
    """An ``nn.Linear`` LM head whose product takes, for each row count, the layout ``choice``
    names (``choice[i]`` for row counts up to ``ladder[i]``); ``F.linear`` above the ladder."""

    def __init__(self, head: nn.Linear, ladder: tuple[int, ...], choice: list[str]) -> None:
        super().__init__()
        self.weight, self.bias = head.weight, head.bias
        self.in_features, self.out_features = head.in_features, head.out_features
        self.ladder, self.choice = ladder, choice

    def layout(self, rows: int) -> str:
        i = bisect.bisect_left(self.ladder, rows)
        return self.choice[i] if i < len(self.choice) else LINEAR

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = LAYOUTS[self.layout(flat.shape[0])](flat, self.weight, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)


def _seconds(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()  # warm: first-call allocations and kernel selection
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


@torch.inference_mode()
def time_layouts(head: nn.Linear, ladder: tuple[int, ...] = ROW_LADDER, reps: int = 5,
                 budget_s: float = TIMING_BUDGET_S) -> list[tuple[int, float, float]]:
    """(rows, F.linear seconds, columns seconds) for each row count of ``ladder`` timed within
    ``budget_s``: the median of ``reps`` calls on random rows of the head's dtype."""
    w, b = head.weight, head.bias
    gen = torch.Generator(device=w.device).manual_seed(0)
    start, rows = time.perf_counter(), []
    for n in ladder:
        if rows and time.perf_counter() - start > budget_s:
            break
        x = torch.randn(n, head.in_features, generator=gen, device=w.device).to(w.dtype)
        rows.append((n, _seconds(lambda x=x: _linear(x, w, b), reps), _seconds(lambda x=x: _columns(x, w, b), reps)))
    return rows


def measured_head(head: nn.Module, timings: list[tuple[int, float, float]] | None = None) -> nn.Module:
    """``head`` with each timed row count's faster layout (``head`` itself when it is not a plain
    ``nn.Linear``, or when ``F.linear`` won everywhere)."""
    if type(head) is not nn.Linear:
        return head
    timings = time_layouts(head) if timings is None else timings
    choice = [COLUMNS if cols < lin else LINEAR for _n, lin, cols in timings]
    if COLUMNS not in choice:
        return head
    ladder = tuple(n for n, _l, _c in timings)
    log.info("LM head layouts by rows (F.linear / columns, ms): %s",
             ", ".join(f"{n}: {lin * 1e3:.2f}/{cols * 1e3:.2f}" for n, lin, cols in timings))
    return MeasuredHead(head, ladder, choice)


def install_measured_head(model) -> None:
    """Give a CPU model the measured LM head (``model.set_output_embeddings``)."""
    head = model.get_output_embeddings()
    if head is None:
        return
    new = measured_head(head)
    if new is not head:
        model.set_output_embeddings(new)
