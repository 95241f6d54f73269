"""Benchmark (not a test): generated tokens/s of the paged continuous executor vs padded HF
``generate`` on the same requests, one CPU process (issue 18 engine target).

    python -m workers.bench_engine --json docs/benchmarks/engine_cpu.json

Requests: 32, prompts 400-800 tokens, outputs 16-256 tokens (seeded). Padded ``generate`` runs
them as one left-padded batch to the longest output (static execution: the batch ends with its
longest row); useful tokens are the requests' own output lengths in both cases.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

import torch

from workers.model import tiny_llama_config
from workers.paged_executor import PagedExecutor
from workers.row_book import BookRow, RowBook

CONFIGS = {"tiny": {}, "h1024-l8": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                                        num_attention_heads=16, num_key_value_heads=8)}


def _requests(n: int, seed: int, vocab: int) -> list[tuple[list[int], int]]:
    rnd = random.Random(seed)
    return [([rnd.randrange(2, vocab - 2) for _ in range(rnd.randint(400, 800))], rnd.randint(16, 256))
            for _ in range(n)]


def _padded(model, reqs) -> float:
    width = max(len(p) for p, _ in reqs)
    ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in reqs])
    mask = (torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p, _ in reqs])[:, None]).long()
    g = max(o for _, o in reqs)
    t = time.perf_counter()
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, max_new_tokens=g, min_new_tokens=g, do_sample=False)
    return time.perf_counter() - t


def _continuous(model, reqs, budget: int, page_size: int = 16) -> float:
    need = sum(-(-(len(p) + o) // page_size) for p, o in reqs)
    book = RowBook(num_pages=need, page_size=page_size, token_budget=budget)
    ex = PagedExecutor(model, book, torch.float32, torch.device("cpu"))
    tokens = {str(i): list(p) for i, (p, _) in enumerate(reqs)}
    left = {str(i): o for i, (_, o) in enumerate(reqs)}
    t = time.perf_counter()
    book.admit([BookRow(str(i), len(p), predicted_remaining=o) for i, (p, o) in enumerate(reqs)])
    while book.rows:
        plan = book.plan_step()
        last = ex.run(plan, tokens)
        book.commit(plan)
        for row_id, lg in last.items():
            if book.rows[row_id].prefill_left:
                continue
            tokens[row_id].append(int(lg.argmax()))
            left[row_id] -= 1
            if left[row_id] == 0:
                book.release(row_id)
    return time.perf_counter() - t


def engine_bench_cli() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--configs", default="tiny,h1024-l8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--budget", type=int, default=2048)
    a = ap.parse_args()
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    results = []
    for name in a.configs.split(","):
        cfg = tiny_llama_config(32000, 0, 1, 1)
        for k, v in CONFIGS[name].items():
            setattr(cfg, k, v)
        cfg.head_dim = cfg.hidden_size // cfg.num_attention_heads
        reqs = _requests(a.requests, 7, cfg.vocab_size)
        useful = sum(o for _, o in reqs)
        model = LlamaForCausalLM(cfg).eval()
        t_pad = _padded(model, reqs)
        t_cont = _continuous(model, reqs, a.budget)
        row = dict(config=name, requests=len(reqs), useful_tokens=useful, padded_generate_s=round(t_pad, 2),
                   continuous_s=round(t_cont, 2), padded_tok_s=round(useful / t_pad, 1),
                   continuous_tok_s=round(useful / t_cont, 1), ratio=round(t_pad / t_cont, 2),
                   torch_threads=torch.get_num_threads())
        print(json.dumps(row), flush=True)
        results.append(row)
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"benchmark": "engine_cpu", "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    engine_bench_cli()
