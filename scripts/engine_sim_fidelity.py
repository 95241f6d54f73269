"""How faithful the fitted simulator is to the engine it was fitted to (docs/engine_sim.md,
"Fidelity against vLLM's CPU build"). Run from the repository root, the client on core 1:

    taskset -c 1 .venv/bin/python scripts/engine_sim_fidelity.py --fit FIT.json --model-dir /tmp/tiny \\
        --out docs/notes/engine_sim_fidelity/fidelity.json

For each KV condition (``roomy``: vLLM's own pool; ``kv40``: 40 blocks, ``--num-gpu-blocks-override
40`` on vLLM and ``--num-gpu-blocks 40`` on the simulator) it starts vLLM's CPU build pinned to core 0
(``taskset -c 0``) and the simulator, fitted (``--fit``), on core 1 with the same pool, block size,
``max_num_seqs``, token budget, ``max_model_len`` and tokenizer (the model's folder), then replays the
same 300-request workload of the Magnus tasks (``bench.workload.make_workload``, streamed with
``bench.upstream_bench.replay_streams`` and ``direct_body``: the true length as ``max_tokens``,
``ignore_eos``) as a burst (every request within 1.5 s; its done/span on the first vLLM run is the
capacity) and at each load fraction of that capacity, in A-B-A order: vLLM, simulator, vLLM
(``--baseline-fit``: the simulator with a second fit runs after the first, before vLLM again). Per
condition and load: the per-request e2e and TTFT errors |sim − vLLM| / vLLM paired by request (against
the mean of the two vLLM runs; the second vLLM run against the first is the noise floor), throughput
and preemptions (``vllm:num_preemptions_total``) of every run. Every process it starts is stopped
(its process group); their logs are under var/bench/engine_sim_fidelity/.

Before the measured runs every engine serves the burst once, unmeasured (``--no-warmup-burst``
skips it): vLLM's first burst after start-up ran 15-20 % slower than its second, three warm-up
requests notwithstanding, and run B could find run A's prompts in its prefix cache. With the warm-up,
every measured run starts from a warm engine whose cache has seen the workload's prompts, the
simulator's too.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.engine_sim.fit_upstream import metric_labels, metric_value
from bench.upstream_bench import direct_body, per_request, replay_streams, summarize
from bench.workload import WorkloadConfig, build_rows, make_workload
from cohort.datasets import data_files
from predictor.estimator import AnalyticBatchTime

ROOT = Path(__file__).resolve().parents[1]
VLLM = ROOT / ".venv-vllm" / "bin" / "vllm"
PY = ROOT / ".venv" / "bin" / "python"
MAX_MODEL_LEN, MAX_NUM_SEQS, BUDGET = 2048, 128, 2048   # the CPU build's defaults for the server, made explicit


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise TimeoutError(f"{url} not healthy after {timeout_s} s")


def start(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            start_new_session=True, cwd=ROOT)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def counters(url: str) -> dict[str, float]:
    """The engine's preemptions and prefix-cache lookups so far (vLLM's names; the simulator's are the same)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {k: metric_value(text, f"vllm:{k}_total") or 0.0 for k in ("num_preemptions", "prefix_cache_queries",
                                                                       "prefix_cache_hits")}


def sim_clock(url: str) -> dict[str, float]:
    """The simulator's step count and its steps that started late (``lag_steps``: its loop could
    not keep up with the model clock on this core, so the run is slower than its model); {} for vLLM."""
    models = httpx.get(f"{url}/v1/models", timeout=10).json().get("data") or [{}]
    state = models[0].get("engine_sim") or {}
    return {k: float(state[k]) for k in ("steps", "lag_steps") if k in state}


def one_run(url: str, wl) -> dict[str, Any]:
    """One replay of ``wl``: its summary, per-request times, the engine's preemptions and the share of
    prompt tokens its prefix cache served (a pool of 40 blocks keeps less of the shared prefixes)."""
    before, clock = counters(url), sim_clock(url)
    res = asyncio.run(replay_streams(wl, f"{url}/v1", direct_body(wl, "tiny")))
    after = counters(url)
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    out = {"summary": summarize(wl, res), "preemptions": after["num_preemptions"] - before["num_preemptions"],
           "prefix_hit_rate": (after["prefix_cache_hits"] - before["prefix_cache_hits"]) / queries if queries else None,
           "per_request": per_request(res)}
    if clock:
        out["sim_clock"] = {k: v - clock.get(k, 0.0) for k, v in sim_clock(url).items()}
    return out


def paired(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """|a − b| / b per request (e2e and TTFT), over the requests both finished."""
    def times(r: dict[str, Any], key: str) -> np.ndarray:
        p = r["per_request"]
        return np.array([np.nan if x is None or s is None else x - s for x, s in zip(p[key], p["sent"], strict=True)])
    out: dict[str, float] = {}
    for key, name in (("done", "e2e"), ("first", "ttft")):
        x, y = times(a, key), times(b, key)
        ok = ~np.isnan(x) & ~np.isnan(y) & (y > 0)
        err = np.abs(x[ok] - y[ok]) / y[ok]
        out[f"{name}_median"] = float(np.median(err))
        out[f"{name}_p90"] = float(np.percentile(err, 90))
        out[f"{name}_signed_median"] = float(np.median((x[ok] - y[ok]) / y[ok]))
    out["throughput"] = a["summary"]["throughput_rps"] / b["summary"]["throughput_rps"] - 1.0
    return out


def mean_run(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Two runs' per-request times averaged (the reference the simulator is compared with)."""
    pa, pb = a["per_request"], b["per_request"]

    def avg(key: str) -> list[float | None]:
        return [None if x is None or y is None else (x + y) / 2 for x, y in zip(pa[key], pb[key], strict=True)]
    thr = (a["summary"]["throughput_rps"] + b["summary"]["throughput_rps"]) / 2
    return {"per_request": {"sent": avg("sent"), "first": avg("first"), "done": avg("done")},
            "summary": {"throughput_rps": thr}}


def condition(name: str, blocks: int | None, args, rows, files: list[str]) -> dict[str, Any]:
    logs = ROOT / "var" / "bench" / "engine_sim_fidelity"
    logs.mkdir(parents=True, exist_ok=True)
    vport, sport = args.port, args.port + 1
    vurl, surl = f"http://127.0.0.1:{vport}", f"http://127.0.0.1:{sport}"
    vcmd = ["taskset", "-c", "0", str(VLLM), "serve", str(args.model_dir), "--host", "127.0.0.1", "--port", str(vport),
            "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--enforce-eager",
            "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(BUDGET)]
    if blocks:
        vcmd += ["--num-gpu-blocks-override", str(blocks)]
    vllm = start(vcmd, logs / f"vllm-{name}.log", {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                                                 "HF_HUB_OFFLINE": "1"})
    sim = base = None
    try:
        wait_healthy(vurl, vllm, 600)
        cache = metric_labels(httpx.get(f"{vurl}/metrics", timeout=10).text, "vllm:cache_config_info")
        scmd = ["taskset", "-c", "1", str(PY), "-m", "bench.engine_sim.cli", "serve", "--port", str(sport),
                "--model-name", "tiny", "--tokenizer", str(args.model_dir), "--fit", str(args.fit),
                "--num-gpu-blocks", cache["num_gpu_blocks"], "--block-size", cache["block_size"],
                "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(BUDGET),
                "--max-model-len", str(MAX_MODEL_LEN)]
        sim = start(scmd, logs / f"sim-{name}.log")
        wait_healthy(surl, sim, 120)
        targets = [("vllm_a", vurl), ("sim", surl)]
        if args.baseline_fit:   # the same simulator with another fit, on the next port, run after the first
            burl = f"http://127.0.0.1:{sport + 1}"
            bcmd = [*scmd, "--fit", str(args.baseline_fit), "--port", str(sport + 1)]
            base = start(bcmd, logs / f"sim-baseline-{name}.log")
            wait_healthy(burl, base, 120)
            targets.append(("sim_baseline", burl))
        targets.append(("vllm_b", vurl))

        def workload(rate: float):
            return make_workload(WorkloadConfig(files=files, requests=args.requests, rate=rate, seed=args.seed,
                                                max_tokens=args.max_tokens), AnalyticBatchTime(), rows)
        # a few requests to each first: vLLM's first requests pay for lazy set-up
        for url in {u for _, u in targets}:
            for _ in range(3):
                httpx.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "warm up", "max_tokens": 8},
                           timeout=60)
        out: dict[str, Any] = {"cache_config_info": cache, "vllm_cmd": vcmd, "sim_cmd": scmd, "loads": {},
                               "warmup_burst": {}}
        if args.warmup_burst:  # every engine first serves the burst once, unmeasured (see the module's doc)
            warmed: set[str] = set()
            for label, url in targets:
                if url in warmed:  # vLLM's second run is on the engine its first one warmed
                    continue
                warmed.add(url)
                out["warmup_burst"][label] = one_run(url, workload(args.requests / 1.5))["summary"]
                print(f"[{name} warm-up] {label}: {out['warmup_burst'][label]['throughput_rps']:.2f} req/s", flush=True)
        capacity = None
        for load in args.loads.split(","):
            rate = args.requests / 1.5 if load == "burst" else float(load) * capacity
            wl = workload(rate)
            runs = {}
            for label, url in targets:
                t0 = time.time()
                runs[label] = one_run(url, wl)
                s = runs[label]["summary"]
                print(f"[{name} {load}] {label}: {s['throughput_rps']:.2f} req/s, p50 e2e {s['p50_latency_s']:.2f} s, "
                      f"p50 TTFT {s['p50_ttft_s']:.3f} s, preemptions {runs[label]['preemptions']:.0f}, "
                      f"prefix hits {runs[label]['prefix_hit_rate'] or 0:.2f}, "
                      f"lost {s['lost']}, {time.time() - t0:.0f} s"
                      + ("" if "sim_clock" not in runs[label] else
                         f", {runs[label]['sim_clock'].get('lag_steps', 0):.0f} of "
                         f"{runs[label]['sim_clock'].get('steps', 0):.0f} steps late"), flush=True)
            if load == "burst":
                capacity = runs["vllm_a"]["summary"]["throughput_rps"]
            ref = mean_run(runs["vllm_a"], runs["vllm_b"])
            out["loads"][load] = {
                "rate_rps": rate, "runs": runs,
                "sim_vs_vllm_mean": paired(runs["sim"], ref),
                "sim_vs_vllm_a": paired(runs["sim"], runs["vllm_a"]),
                "sim_vs_vllm_b": paired(runs["sim"], runs["vllm_b"]),
                "vllm_b_vs_vllm_a": paired(runs["vllm_b"], runs["vllm_a"])}
            if "sim_baseline" in runs:
                out["loads"][load]["baseline_vs_vllm_mean"] = paired(runs["sim_baseline"], ref)
            e = out["loads"][load]["sim_vs_vllm_mean"]
            print(f"[{name} {load}] sim vs vLLM: e2e median {100 * e['e2e_median']:.1f} % p90 {100 * e['e2e_p90']:.1f} %,"
                  f" TTFT median {100 * e['ttft_median']:.1f} %, throughput {100 * e['throughput']:+.1f} %", flush=True)
        out["capacity_rps"] = capacity
        return out
    finally:
        for proc in (sim, base):
            if proc is not None:
                stop(proc)
        stop(vllm)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = [(c, lo, d) for c, cond in result["conditions"].items() for lo, d in cond["loads"].items()]
    labels = [f"{c}\n{lo}" for c, lo, _ in cells]
    keys = (("e2e_median", "e2e error, median"), ("e2e_p90", "e2e error, p90"), ("ttft_median", "TTFT error, median"),
            ("throughput", "throughput error"))
    fig, axes = plt.subplots(1, len(keys) + 1, figsize=(5 * (len(keys) + 1), 4))
    x = np.arange(len(cells))
    for ax, (k, title) in zip(axes, keys, strict=False):
        ax.bar(x - 0.2, [100 * abs(d["sim_vs_vllm_mean"][k]) for _, _, d in cells], 0.4, label="sim vs vLLM")
        ax.bar(x + 0.2, [100 * abs(d["vllm_b_vs_vllm_a"][k]) for _, _, d in cells], 0.4, label="vLLM run 2 vs run 1")
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(f"{title} (%)")
    axes[0].legend(fontsize=7)
    ax = axes[-1]
    for c, lo, d in cells:
        pv, ps = d["runs"]["vllm_a"]["per_request"], d["runs"]["sim"]["per_request"]
        xs = [dn - s for dn, s in zip(pv["done"], pv["sent"], strict=True) if dn is not None]
        ys = [dn - s for dn, s in zip(ps["done"], ps["sent"], strict=True) if dn is not None]
        n = min(len(xs), len(ys))
        ax.scatter(xs[:n], ys[:n], s=3, label=f"{c} {lo}")
    lim = ax.get_xlim()
    ax.plot(lim, lim, "k--", lw=0.5)
    ax.set_xlabel("vLLM e2e (s)")
    ax.set_ylabel("sim e2e (s)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fit", type=Path, required=True, help="cohort engine-sim fit's file for this vLLM")
    ap.add_argument("--baseline-fit", type=Path, help="also run the simulator with this fit (after the first)")
    ap.add_argument("--model-dir", type=Path, required=True, help="cohort worker export-model's folder")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--conditions", default="roomy,kv40", help="roomy and/or kv40")
    ap.add_argument("--loads", default="burst,0.5,0.9", help="burst first: it gives the capacity")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup-burst", action=argparse.BooleanOptionalAction, default=True,
                    help="serve the burst once on every engine before the measured runs")
    ap.add_argument("--port", type=int, default=8320)
    args = ap.parse_args()
    if not args.loads.startswith("burst"):
        sys.exit("--loads must start with burst (the capacity the fractions are of)")
    files = [str(p) for p in data_files()]
    rows = build_rows(files, None)
    result: dict[str, Any] = {"date": datetime.date.today().isoformat(), "fit": json.loads(args.fit.read_text()),
                              "requests": args.requests, "max_tokens": args.max_tokens, "seed": args.seed,
                              "machine": f"{os.cpu_count()} cores, shared with other engineers' benchmarks",
                              "conditions": {}}
    for name in args.conditions.split(","):
        result["conditions"][name] = condition(name, 40 if name == "kv40" else None, args, rows, files)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1, default=float))
    plot(result, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
