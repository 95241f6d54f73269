"""Recompute-cost samples: the continuous engine's packed prefill of β rows × L tokens, timed
cleanly (`cohort worker profile-prefill`, ``launch.prefill_profile``).

torch and the paged executor are imported at the top: whoever imports this module runs a model.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from batcher.running_set import RunningSet, RunRow
from workers.paged_executor import PagedExecutor

CLOCKS: dict[str, Callable[[], float]] = {"thread": time.thread_time, "process": time.process_time,
                                          "wall": time.perf_counter}


class PrefillTimer:
    """Times what a recompute really runs in the continuous engine: one packed prefill step of
    ``size`` rows of ``input_len`` tokens through ``PagedExecutor`` (the live engine's executor).

    Why not ``LLMEngine.run_shape``: that runs the padded decode loop (sampling, bookkeeping,
    tensors allocated per call), whose Python overhead scatters more than the compute. Noise
    control, because a neighbour on a shared CPU can only add time: per shape one untimed warm-up
    run, then ``repeats`` timed runs with the garbage collector off, each on the ``thread`` clock
    (CPU seconds of this thread: with one torch thread, the prefill's own compute, not the time
    other processes held the core). The sample is the fastest run; the spread of the others is
    reported beside it.
    """

    def __init__(self, model: Any, dtype: Any, device: Any, max_tokens: int, page_size: int = 16,
                 clock: str = "thread") -> None:
        self.device, self.clock, self.page_size = device, CLOCKS[clock], page_size
        self.book = RunningSet(max_tokens // page_size + 64, page_size, token_budget=max_tokens)
        self.executor = PagedExecutor(model, self.book, dtype, device)

    def _sync(self) -> None:
        if getattr(self.device, "type", "cpu") == "cuda":
            torch.cuda.synchronize(self.device)

    def time_shape(self, size: int, input_len: int, repeats: int) -> list[float]:
        """Seconds of ``repeats`` packed prefills of this shape (after one warm-up run)."""
        rows = [RunRow(f"p{k}", input_len) for k in range(size)]
        if not self.book.admit(rows):
            raise ValueError(f"{size}×{input_len} tokens exceed the timer's page pool")
        self.book.token_budget = size * input_len
        try:
            plan = self.book.plan_step()
            ids = {r.row_id: [1000 + (i * 7 + k) % 5000 for i in range(input_len)] for k, r in enumerate(rows)}
            times = []
            was_enabled = gc.isenabled()
            gc.collect()
            gc.disable()
            try:
                with torch.inference_mode():
                    self.executor.run(plan, ids)  # warm-up: first touch of this shape's buffers
                    for _ in range(repeats):
                        self._sync()
                        t = self.clock()
                        self.executor.run(plan, ids)
                        self._sync()
                        times.append(self.clock() - t)
            finally:
                if was_enabled:
                    gc.enable()
            return times
        finally:
            for r in rows:
                self.book.release(r.row_id)


def repeat_spread(times: Sequence[float]) -> float:
    """How far a shape's repeats scatter above its fastest run: (median − min) ÷ min, in percent."""
    best = min(times)
    return float((sorted(times)[len(times) // 2] - best) / best * 100.0) if best > 0 else 0.0


def profile_prefill_shapes(timer: PrefillTimer, shapes: Sequence[tuple[int, int]], repeats: int, rounds: int = 1,
                           seed: int = 0, show_progress: bool = True) -> list[dict[str, Any]]:
    """One sample per (β, L): the fastest of its runs, with every run and the spread kept
    (``load_prefill_samples`` reads ``seconds``; the repeats let a reader judge the floor).

    ``rounds`` passes over the grid, each in a fresh seeded order, ``repeats`` runs per visit:
    a neighbour's busy phase lasts seconds, so repeats taken back to back share it and their
    minimum does not remove it; visits spread over the whole profile do.
    """
    shapes = [(int(b), int(L)) for b, L in shapes]
    times: dict[tuple[int, int], list[float]] = {s: [] for s in shapes}
    order = [list(shapes) for _ in range(rounds)]
    rng = random.Random(seed)
    for r in order:
        rng.shuffle(r)
    for b, L in tqdm([s for r in order for s in r], desc="prefill", disable=not show_progress):
        times[(b, L)] += [round(t, 9) for t in timer.time_shape(b, L, repeats)]
    return [{"size": b, "input_len": L, "gen_len": 1, "seconds": min(times[(b, L)]), "repeats": times[(b, L)],
             "spread_pct": round(repeat_spread(times[(b, L)]), 3)} for b, L in shapes]
