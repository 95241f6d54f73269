"""``cohort bench adaptive``: AdaptiveLLM's experiment (§4.2–4.4) in the continuous simulator.

The paper runs vLLM 0.2.5 memory-starved on purpose (128 GPU blocks of 16 tokens, 64 CPU blocks),
1,000 sampled requests, maximum output 64 and 256, and compares vLLM's greedy default (recompute),
vLLM_s (always swap) and AdaptiveLLM (swap only when predicted cheaper, ``batcher.preemption``),
each under FCFS and its fairness scheduler (``adaptive-fair``). Here the same grid runs on
``bench.continuous`` with the Llama-13B preset on an A800 (the paper's GPU; its PCIe link prices a
swap), on the shared Alpaca rows and on the Magnus tasks. ``chunked_prefill=False`` models the
paper's vLLM 0.2.5 (a step that admits prompts runs only them, so a recompute stalls every
decoding row); the default is cohort's engine, where a re-prefill rides inside a decode step. Requests are all sent at t = 0 (the
paper's offline throughput run) unless ``rate`` is given. Why a module of its own: the grid,
its JSON shape and its plot are this experiment's, the engine is everyone's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from batcher.memory import KVMemory
from batcher.preemption import PREEMPTION_MODES
from bench.continuous import EngineLimits
from bench.continuous_run import ADAPTIVE_FAIR, CB_FCFS
from bench.report import pyplot
from bench.roofline import instance
from bench.simulator import simulate
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import MAGNUS_TASKS, data_files

DATASETS: dict[str, tuple[str, ...]] = {"alpaca": ("alpaca",), "magnus": tuple(MAGNUS_TASKS)}
SCHEDULERS: dict[str, str] = {"fcfs": CB_FCFS, "adaptive-fair": ADAPTIVE_FAIR}
# vLLM 0.2.5 raises "Aborted due to the lack of CPU swap space" when a swap victim finds the host
# pool full, which ends the whole run; a throughput cannot be read from that, so here the victim
# is recomputed instead (counted per run as ``swap_fallbacks``): the swap-only baseline at its best.
SWAP_WHEN_HOST_FULL = "victim recomputed (vLLM 0.2.5 aborts the engine); counted as swap_fallbacks"
RUN_KEYS = ("max_output", "data", "policy", "preemption", "request_throughput", "weighted_turnaround",
            "mean_latency_s", "swaps", "recomputes")


def run_adaptive(requests: int = 1000, max_outputs: Sequence[int] = (64, 256),
                 datasets: Sequence[str] = ("alpaca", "magnus"), gpu_pages: int = 128, host_pages: int = 64,
                 gpu: str = "a800-80gb", model: str = "llama-13b", max_num_seqs: int = 256, rate: float = 0.0,
                 seed: int = 0, progress: Callable[[str], None] | None = None,
                 files: dict[str, Sequence[str]] | None = None, chunked_prefill: bool = True) -> dict[str, Any]:
    """The whole grid: {"config": ..., "runs": [{RUN_KEYS..., plus p99 latency and TTFT}]}.
    ``files`` maps a dataset name to its JSONL files (default: ``DATASETS`` in the shared data).
    ``chunked_prefill=False`` runs the engine as vLLM 0.2.5 (``EngineLimits.chunked_prefill``)."""
    inst = instance(gpu, model)
    tm = inst.time_model()
    limits = EngineLimits(max_num_seqs=max_num_seqs) if chunked_prefill else \
        EngineLimits.vllm_025(gpu_pages, max_num_seqs)
    memory = KVMemory(inst.model.delta_bytes, gpu_pages * limits.page_tokens * inst.model.delta_bytes)
    runs: list[dict[str, Any]] = []
    for data in datasets:
        paths = [str(p) for p in (files or {}).get(data) or data_files(DATASETS[data])]
        rows = build_rows(paths, None)
        for mo in max_outputs:
            wc = WorkloadConfig(files=paths, requests=requests, rate=rate or 1.0, seed=seed, max_tokens=mo)
            reqs = make_workload(wc, tm, rows).requests(oracle=True)
            if not rate:
                reqs = [replace(r, arrival=0.0) for r in reqs]
            for pol, sched in SCHEDULERS.items():
                for mode in PREEMPTION_MODES:
                    res = simulate(reqs, sched, memory, tm, instances=1, execution="continuous",
                                   oom_recovery="preempt", limits=limits, preemption=mode,
                                   link=inst.swap_link(), host_pages=host_pages)
                    m = res.metrics
                    run = {"max_output": mo, "data": data, "policy": pol, "preemption": mode,
                           **{k: m[k] for k in RUN_KEYS[4:]}, "p99_latency_s": m["p99_latency_s"],
                           "mean_ttft_s": m["mean_ttft_s"], "completed": m["completed"], "failed": m["failed"],
                           "preemptions": m["preemptions"], "transfer_s": res.extra["transfer_s"],
                           "swap_fallbacks": res.extra["swap_fallbacks"]}
                    runs.append(run)
                    if progress:
                        progress(f"{data} max_output={mo} {pol}/{mode}: {m['request_throughput']:.2f} req/s, "
                                 f"WT {m['weighted_turnaround']:.2f}, swaps {m['swaps']}, recomputes "
                                 f"{m['recomputes']}")
    config = {"runner": "adaptive", "requests": requests, "max_outputs": list(max_outputs),
              "datasets": {d: list((files or {}).get(d) or DATASETS[d]) for d in datasets}, "gpu_pages": gpu_pages,
              "host_pages": host_pages, "page_tokens": limits.page_tokens, "max_num_seqs": max_num_seqs,
              "engine": "cohort (chunked prefill)" if chunked_prefill else "vllm-0.2.5 (prefill-only steps)",
              "limits": {"max_batched_tokens": limits.max_batched_tokens, "max_paddings": limits.max_paddings,
                         "watermark_pages": limits.watermark_pages, "chunked_prefill": limits.chunked_prefill},
              "swap_when_host_full": SWAP_WHEN_HOST_FULL,
              "rate": rate or "all at t=0", "seed": seed, "instance": inst.describe(),
              "time_model": tm.to_dict()}
    return {"config": config, "runs": runs}


def _find(runs: list[dict[str, Any]], **kw: Any) -> dict[str, Any] | None:
    return next((r for r in runs if all(r[k] == v for k, v in kw.items())), None)


def target_lines(runs: list[dict[str, Any]]) -> list[str]:
    """AdaptiveLLM's simulator targets, one line per (data, max output, policy)."""
    out = []
    for r in runs:
        if r["preemption"] != "adaptive":
            continue
        key = {"max_output": r["max_output"], "data": r["data"]}
        rec = _find(runs, **key, policy=r["policy"], preemption="recompute")
        swp = _find(runs, **key, policy=r["policy"], preemption="swap")
        fcfs = _find(runs, **key, policy="fcfs", preemption="recompute")
        thr = r["request_throughput"]
        a = thr / rec["request_throughput"] if rec and rec["request_throughput"] else math.nan
        b = thr / swp["request_throughput"] if swp and swp["request_throughput"] else math.nan
        line = (f"{r['data']:7s} max_output={r['max_output']:<4d} {r['policy']:13s} adaptive/recompute "
                f"{a:5.2f}x  adaptive/swap {b:5.2f}x")
        if r["policy"] == "adaptive-fair" and fcfs:
            line += f"  WT/fcfs-recompute {r['weighted_turnaround'] / fcfs['weighted_turnaround']:5.2f}x"
        out.append(line)
    return out


def plot_adaptive(runs: list[dict[str, Any]], out: Path, title: str = "AdaptiveLLM experiment, simulated") -> Path:
    """Throughput and weighted turnaround per (data, max output): one bar per policy/preemption."""
    plt = pyplot()
    groups = sorted({(r["data"], r["max_output"]) for r in runs})
    combos = [(p, m) for p in SCHEDULERS for m in PREEMPTION_MODES]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.4))
    w = 0.8 / len(combos)
    for ax, metric, label in ((axes[0], "request_throughput", "request throughput (req/s)"),
                              (axes[1], "weighted_turnaround", "mean weighted turnaround (eq. 5)")):
        for i, (p, m) in enumerate(combos):
            vals = [(_find(runs, data=d, max_output=mo, policy=p, preemption=m) or {}).get(metric, math.nan)
                    for d, mo in groups]
            ax.bar([g + i * w for g in range(len(groups))], vals, w, label=f"{p}/{m}",
                   hatch="//" if p == "adaptive-fair" else None)
        ax.set_xticks([g + 0.4 - w / 2 for g in range(len(groups))], [f"{d}\nmax out {mo}" for d, mo in groups])
        ax.set_ylabel(label)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
