"""`cohort worker profile`: time a grid of batch shapes on the configured model.

The samples ((β, L, G) → wall seconds) are the analytic estimator's cold-start data and the
KNN estimator's first training set (continuous learning seeds its sample store from them).
It needs no torch: the engine it times is handed in (the worker's ``LLMEngine.run_shape``). The
recompute-cost samples (one packed prefill at a time) are ``workers.prefill_timer``'s.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from tqdm.auto import tqdm

from predictor.estimator import AnalyticBatchTime


class ShapeRunner(Protocol):
    """What profiling needs from the worker's engine."""

    def run_shape(self, size: int, input_len: int, gen_len: int) -> float: ...


def run_profile(engine: ShapeRunner, shapes: Sequence[tuple[int, int, int]], out_path: str | Path,
                warmup: bool = True, repeats: int = 1, show_progress: bool = True) -> list[dict[str, Any]]:
    """Run every (β, L, G) shape (``repeats`` times), store the samples and the fitted analytic
    model as JSON at ``out_path`` (written atomically), and return the samples.

    One untimed warm-up run first: the first forward pass pays for lazy initialisation, which would
    otherwise inflate the first sample.
    """
    shapes = [(int(b), int(L), int(G)) for b, L, G in shapes]
    if warmup and shapes:
        b, L, G = min(shapes)
        engine.run_shape(b, L, min(G, 4))
    samples: list[dict[str, Any]] = []
    for b, L, G in tqdm([s for s in shapes for _ in range(repeats)], desc="profile", disable=not show_progress):
        seconds = float(engine.run_shape(b, L, G))
        samples.append({"size": b, "input_len": L, "gen_len": G, "seconds": seconds})
    analytic = AnalyticBatchTime.from_samples(samples)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path.with_name(f".{out_path.name}.tmp")
    tmp.write_text(json.dumps({"created": time.time(), "samples": samples,
                               "analytic": analytic.to_dict() if analytic else None}, indent=2))
    os.replace(tmp, out_path)
    return samples
