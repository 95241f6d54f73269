"""Benchmark (not a test): generated tokens/s of the three execution paths on the same requests,
one CPU process.

    python -m launch.engine_bench --json docs/notes/benchmarks/engine_cpu.json

Requests: 32, prompts 400-800 tokens, outputs 16-256 tokens (seeded), lengths emulated (EOS
forced at each request's length) so every path generates exactly the same tokens:

- ``padded_generate``: HF ``generate`` on one left-padded batch to the longest output (static
  execution: the batch ends with its longest row);
- ``elastic``: cohort's padded decode loop (``workers.padded_run``: rows leave as they finish);
- ``continuous``: cohort's continuous run (``workers.continuous``: packed chunked prefill, paged
  KV, per-row decode) with the whole request set submitted as admission groups of 8; its text
  is rendered in the same process (on the worker the instance's publisher thread does it).

Useful tokens are the requests' own output lengths in every case.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

from cohort.tokenizer import load_tokenizer
from cohort.types import Batch, ProfiledRequest
from workers.continuous import ContinuousRun
from workers.model import tiny_llama_config
from workers.padded_run import PaddedRun
from workers.row_text import TextStage

CONFIGS = {"tiny": {}, "h1024-l8": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=8)}


def _requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rnd = random.Random(seed)
    return [([rnd.randrange(1000, vocab - 2) for _ in range(rnd.randint(400, 800))], rnd.randint(16, 256))
            for _ in range(n)]


def _profiled(reqs) -> list[ProfiledRequest]:
    return [ProfiledRequest(id=f"q{i}", prompt="", input_tokens=len(p), predicted_tokens=o, max_tokens=o,
                            arrival=0.0, emulated_tokens=o, prompt_ids=list(p)) for i, (p, o) in enumerate(reqs)]


def _sync(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _padded(model, tok, reqs, device: torch.device) -> float:
    width = max(len(p) for p, _ in reqs)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p, _ in reqs], device=device)
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p, _ in reqs])[:, None]).long()
    g = max(o for _, o in reqs)
    t = _sync(device)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask.to(device), max_new_tokens=g, min_new_tokens=g, do_sample=False,
                       pad_token_id=tok.pad_token_id)
    return _sync(device) - t


def _elastic(model, tok, reqs, device: torch.device) -> float:
    run = PaddedRun(model, tok, device, 1, None, _profiled(reqs), emulate=True, prompt_ids=[p for p, _ in reqs])
    t = _sync(device)
    run.run_to_end()
    return _sync(device) - t


def _continuous(model, tok, reqs, device: torch.device, budget: int, page_size: int = 16, group: int = 8) -> float:
    pages = sum(-(-(len(p) + o + 1) // page_size) for p, o in reqs)
    run = ContinuousRun(model, tok, device, next(model.parameters()).dtype, num_pages=pages, page_size=page_size,
                        token_budget=budget, emulate=True)
    profiled = _profiled(reqs)
    t = _sync(device)
    for k in range(0, len(profiled), group):
        part = profiled[k:k + group]
        run.submit(Batch(id=f"b{k}", requests=part, created=0.0), [r.prompt_ids for r in part])
    stages: dict[str, TextStage] = {}
    while not run.idle:
        for bid, out in run.step().items():  # the text, rendered on the worker by its publisher
            stages.setdefault(bid, TextStage(tok)).render(out)
        run.finished_groups()
    return _sync(device) - t


def engine_bench_cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--configs", default="tiny,h1024-l8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args()
    device, dtype = torch.device(a.device), getattr(torch, a.dtype)
    if a.threads:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    tok = load_tokenizer()
    results = []
    for name in a.configs.split(","):
        cfg = tiny_llama_config(len(tok), tok.pad_token_id, tok.eos_token_id, None)
        for k, v in CONFIGS[name].items():
            setattr(cfg, k, v)
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        reqs = _requests(a.requests, 7, cfg.vocab_size)
        useful = sum(o for _, o in reqs)
        model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype).eval()
        _padded(model, tok, reqs[:2], device)  # warm-up (CUDA context, kernels)
        times, cpu = {}, {}
        for mode, fn, extra in (("padded_generate", _padded, ()), ("elastic", _elastic, ()),
                                ("continuous", _continuous, (a.budget,))):
            c0 = time.process_time()
            times[mode] = fn(model, tok, reqs, device, *extra)
            cpu[mode] = time.process_time() - c0  # on a shared CPU, the process's own seconds
        row = dict(config=name, device=str(device), dtype=a.dtype, requests=len(reqs), useful_tokens=useful,
                   step_token_budget=a.budget, torch_threads=torch.get_num_threads(),
                   **{f"{k}_s": round(v, 2) for k, v in times.items()},
                   **{f"{k}_tok_s": round(useful / v, 1) for k, v in times.items()},
                   continuous_x_padded_generate=round(times["padded_generate"] / times["continuous"], 2),
                   continuous_x_elastic=round(times["elastic"] / times["continuous"], 2),
                   **{f"{k}_cpu_s": round(v, 2) for k, v in cpu.items()},
                   cpu_continuous_x_padded_generate=round(cpu["padded_generate"] / cpu["continuous"], 2),
                   cpu_continuous_x_elastic=round(cpu["elastic"] / cpu["continuous"], 2))
        print(json.dumps(row), flush=True)
        results.append(row)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"benchmark": "engine_cpu", "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    engine_bench_cli()
