"""`cohort worker profile-prefill`: the recompute-cost predictor's samples, timed in CPU seconds.

Why not `cohort worker profile` as it is: it times wall seconds, and on a CPU shared with other
processes a neighbour inflates a tiny model's prefill several times over (seen here: 0.03 s and
0.30 s for the same shape on a 2-core machine at load 12), so no regression can reach the 2 %
error the recompute-cost predictor is held to. This command runs the same shapes through the same
profiler (``workers.profile.run_profile`` over ``LLMEngine.run_shape``) but reads the process's
CPU time around each run, with one torch thread so CPU time is the prefill's own compute. The
JSON is the profiler's (``samples`` of size, input_len, gen_len, seconds) plus ``clock``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer


class CPUTimeRunner:
    """A ``workers.profile.ShapeRunner`` that reports the process CPU seconds of each shape."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def run_shape(self, size: int, input_len: int, gen_len: int) -> float:
        t0 = time.process_time()
        self.engine.run_shape(size, input_len, gen_len)
        return time.process_time() - t0


def profile_prefill(
    out: Path = typer.Option(Path("var/profile/prefill-cpu.json"), help="Where to store the samples."),
    sizes: str = typer.Option("1,2,3,4,6,8,12,16", help="Batch sizes β."),
    input_lens: str = typer.Option("16,32,48,64,96,128,192,256,384,512", help="Prompt tokens per row."),
    repeats: int = typer.Option(3, help="Runs per shape (the predictor keeps each shape's fastest)."),
    threads: int = typer.Option(1, help="torch CPU threads (1: CPU time is the prefill's own)."),
) -> None:
    """Prefill shapes (gen_len 1) on the configured model, timed in process CPU seconds."""
    import torch

    from cohort.settings import get_settings
    from workers.engine import LLMEngine
    from workers.profile import run_profile

    torch.set_num_threads(threads)
    engine = LLMEngine(get_settings())
    grid = [(b, L, 1) for b in map(int, sizes.split(",")) for L in map(int, input_lens.split(","))]
    shapes = [s for s in grid if engine.fits(*s)]
    samples = run_profile(CPUTimeRunner(engine), shapes, out, repeats=repeats)
    data = json.loads(out.read_text())
    cfg = engine.model.config
    data.update(clock="process_cpu", threads=threads, layers=int(cfg.num_hidden_layers),
                hidden=int(cfg.hidden_size))
    out.write_text(json.dumps(data, indent=2))
    typer.echo(json.dumps({"samples": len(samples), "out": str(out), "layers": data["layers"],
                           "hidden": data["hidden"]}))
