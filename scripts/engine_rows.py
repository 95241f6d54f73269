"""Benchmark (not a test): the continuous engine's step time by decoding rows, on the built-in
tiny model in one CPU process (one torch thread, as the worker runs), in four settings measured
side by side, alternating, on the same requests:

- ``linear, multinomial``: the LM head as ``F.linear`` and sampled rows drawn by ``torch.multinomial``
  (the engine before docs/notes/steady.md run 10);
- ``linear, cdf``: the same head, rows drawn by ``workers.sampling.draw`` (inverse CDF);
- ``measured, cdf``: the head the worker installs at load (``workers.lm_head``), rows drawn by CDF;
- ``measured, greedy``: the same head, greedy rows (one argmax for the step).

    .venv/bin/python scripts/engine_rows.py docs/notes/steady/engine-rows

writes ``<out>.json`` and ``<out>.png``: mean seconds per step at each row count, each setting.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from unittest import mock

import torch

from cohort.settings import Settings
from cohort.types import Batch, ProfiledRequest, SamplingParams
from workers import sampling
from workers.continuous import ContinuousRun
from workers.engine import LLMEngine

ROWS = (1, 2, 3, 4, 6, 8, 12, 16)
STEPS, REPEATS = 150, 3
PROMPT = "Summarise the following text about static batching and scheduling of requests " * 3


def multinomial_draw(scores: torch.Tensor, u: torch.Tensor) -> int:
    """The sampler before run 10: a multinomial draw from the softmax (``u`` seeds it)."""
    gen = torch.Generator().manual_seed(int(u * 2**31))
    return int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=gen))


def step_seconds(eng: LLMEngine, rows: int, greedy: bool, tag: str) -> float:
    run = ContinuousRun(eng.model, eng.tokenizer, eng.device, torch.float32, num_pages=2048, page_size=16,
                        token_budget=512, emulate=True)
    sp = SamplingParams() if greedy else SamplingParams(temperature=1.0)
    reqs = [ProfiledRequest(id=f"{tag}-{i}", prompt=PROMPT + str(i), input_tokens=48, arrival=0.0,
                            predicted_tokens=400, max_tokens=400, emulated_tokens=400, sampling=sp)
            for i in range(rows)]
    run.submit(Batch(id=tag, requests=reqs, created=0.0), [eng.prompt_ids(r.prompt) for r in reqs])
    for _ in range(5):  # the prompts' prefill, then decode only
        run.step()
    t0 = time.perf_counter()
    for _ in range(STEPS):
        run.step()
    return (time.perf_counter() - t0) / STEPS


def main(out: str) -> None:
    torch.set_num_threads(1)
    eng = LLMEngine(Settings())
    measured = eng.model.get_output_embeddings()
    plain = torch.nn.Linear(measured.in_features, measured.out_features, bias=False)
    plain.weight = measured.weight
    settings = {"linear, multinomial": (plain, multinomial_draw, False), "linear, cdf": (plain, sampling.draw, False),
                "measured, cdf": (measured, sampling.draw, False), "measured, greedy": (measured, sampling.draw, True)}
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in ROWS} for name in settings}
    for rep in range(REPEATS):
        for n in ROWS:
            for name, (head, draw, greedy) in settings.items():
                eng.model.set_output_embeddings(head)
                with mock.patch.object(sampling, "draw", draw):
                    times[name][n].append(step_seconds(eng, n, greedy, f"{name}-{n}-{rep}"))
            print(f"rep {rep} rows {n}: " + ", ".join(f"{k} {v[n][-1] * 1e3:.2f} ms" for k, v in times.items()),
                  flush=True)
    eng.model.set_output_embeddings(measured)
    result = {"rows": list(ROWS), "steps": STEPS, "repeats": REPEATS,
              "head_layouts": dict(zip(map(str, measured.ladder), measured.choice, strict=True))
              if hasattr(measured, "choice") else None,
              "step_ms": {k: [1e3 * sum(v[n]) / len(v[n]) for n in ROWS] for k, v in times.items()}}
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    import matplotlib  # a plot only at the end: the benchmark itself needs no display

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for k, v in result["step_ms"].items():
        ax.plot(ROWS, v, marker="o", label=k)
    ax.set_xlabel("decoding rows")
    ax.set_ylabel("ms per step")
    ax.set_title("continuous engine step, tiny Llama, 1 CPU thread")
    ax.legend()
    fig.tight_layout()
    fig.savefig(f"{out}.png", dpi=110)
    print(json.dumps(result["step_ms"], indent=1))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "var/bench/engine-rows")
