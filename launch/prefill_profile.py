"""`cohort worker profile-prefill`: the recompute-cost predictor's samples.

Each sample is what a recompute runs in the continuous engine: one packed prefill step of β rows
of L tokens through the live executor (``workers.prefill_timer.PrefillTimer``). Why not wall seconds of
`cohort worker profile`: on a CPU shared with other processes a neighbour inflates a tiny model's
prefill several times over (0.03 s and 0.30 s for one shape on a 2-core machine at load 12), and
no regression reaches the 2 % error the predictor is held to. So: one torch thread, a warm-up run
per visit, the garbage collector off while timing, the CPU seconds of the timing thread, and the
fastest of ``--rounds`` × ``--repeats`` runs, the rounds in shuffled orders so that a neighbour's
busy phase does not cover every run of one shape (contention only ever adds time). The JSON keeps
every run, each shape's spread (median over fastest) and the load average before and after.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import typer


def profile_prefill(
    out: Path = typer.Option(Path("var/profile/prefill-cpu.json"), help="Where to store the samples."),
    sizes: str = typer.Option("1,2,3,4,5,6,7,8", help="Batch sizes β (every one: the live decision asks for any β)."),
    input_lens: str = typer.Option(",".join(str(n) for n in range(16, 257, 16)), help="Prompt tokens per row."),
    repeats: int = typer.Option(4, help="Timed runs per visit of a shape, after one warm-up run."),
    rounds: int = typer.Option(4, help="Passes over the grid, each in a shuffled order (the sample is the "
                               "fastest of rounds × repeats runs, taken minutes apart)."),
    threads: int = typer.Option(1, help="torch CPU threads (1: the thread clock is the prefill's own compute)."),
    clock: str = typer.Option("thread", help="thread | process (CPU seconds) | wall (CUDA: always use wall)."),
) -> None:
    """Packed prefill shapes on the configured model, each the fastest of --repeats clean runs."""
    import numpy as np
    import torch

    from cohort.settings import get_settings
    from workers.engine import LLMEngine
    from workers.prefill_timer import PrefillTimer, profile_prefill_shapes

    torch.set_num_threads(threads)
    engine = LLMEngine(get_settings())
    shapes = [(b, L) for b in map(int, sizes.split(",")) for L in map(int, input_lens.split(","))]
    timer = PrefillTimer(engine.model, engine.dtype, engine.device, max(b * L for b, L in shapes),
                         engine.settings.continuous.page_tokens, clock=clock)
    load_before, t0 = os.getloadavg(), time.time()
    samples = profile_prefill_shapes(timer, shapes, repeats, rounds)
    cfg = engine.model.config
    spreads = [s["spread_pct"] for s in samples]
    data = {"created": time.time(), "samples": samples, "clock": clock, "threads": threads, "repeats": repeats, "rounds": rounds,
            "executor": "paged_packed_prefill", "model": engine.settings.model, "device": str(engine.device),
            "layers": int(cfg.num_hidden_layers), "hidden": int(cfg.hidden_size),
            "spread_pct": {"mean": float(np.mean(spreads)), "median": float(np.median(spreads)),
                           "max": float(np.max(spreads))},
            "loadavg_1m": {"before": load_before[0], "after": os.getloadavg()[0]}, "wall_s": time.time() - t0}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2))
    typer.echo(json.dumps({k: data[k] for k in ("out", "layers", "hidden", "spread_pct", "loadavg_1m", "wall_s")
                           if k in data} | {"samples": len(samples), "out": str(out)}))
