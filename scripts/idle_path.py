"""Where cohort's fixed cost per request goes in front of an upstream, at idle (docs/notes/upstream.md
"The batcher wakes on work").

Sends N sequential streamed completions (16 tokens, prompts from ``../shared/data/bf.jsonl``) to
the engine direct, then to a spawned cohort stack (spf) in front of it, and reports the median TTFT
and e2e of both, and cohort's hops from its log DB: client send -> the request's record
(``created``: the gateway's admission), record -> its batch's ``created`` (the batcher's pick-up),
batch ``created`` -> ``started`` (Celery to the upstream worker, and the group's admission). Run
from the repository root, with the engine up:

    .venv/bin/python scripts/idle_path.py http://127.0.0.1:8100/v1 40 var/bench/idle-path [KEY=VALUE ...]

``KEY=VALUE``: extra server settings for the stack (``COHORT_PREDICTOR_DIR=...``).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import create_engine, text

from bench.live_stack import spawned_stack
from cohort.datasets import shared_data_dir


def _run(url: str, model: str, prompts: list[str], cohort: bool) -> list[tuple[float, float, float]]:
    """(send, first text chunk, last chunk) wall times of each request, one at a time."""
    out = []
    with httpx.Client(timeout=60) as c:
        for p in prompts:
            body = {"model": model, "prompt": p, "max_tokens": 16, "temperature": 0, "stream": True}
            body.update({"emulated_tokens": 16} if cohort else {"ignore_eos": True})
            t0, first = time.time(), None
            with c.stream("POST", f"{url}/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if first is None and line.startswith("data:") and '"text"' in line:
                        first = time.time()
            out.append((t0, first or time.time(), time.time()))
            time.sleep(0.05)
    return out


def _ms(xs: list[float]) -> str:
    return f"{statistics.median(xs) * 1e3:.1f} ms" if xs else "-"


def main(engine: str, n: int, workdir: Path, extra: dict[str, str]) -> dict[str, str]:
    with (shared_data_dir() / "bf.jsonl").open() as f:
        prompts = [json.loads(line)["instruction"][:400] for line, _ in zip(f, range(n), strict=False)]
    model = httpx.get(f"{engine}/models", timeout=10).json()["data"][0]["id"]
    direct = _run(engine, model, prompts, cohort=False)
    env = {"COHORT_UPSTREAMS": engine, "COHORT_ENCODER_THREADS": "1", **extra}
    with spawned_stack("spf", env, workdir) as url:
        served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        _run(f"{url}/v1", served, prompts[:5], cohort=True)  # warm-up: imports, first connections
        through = _run(f"{url}/v1", served, prompts, cohort=True)
    db = create_engine(f"sqlite:///{workdir / 'spf' / 'cohort.db'}")
    with db.connect() as c:
        reqs = c.execute(text("select created, batch_id from requests order by created desc limit :n"),
                         {"n": n}).fetchall()[::-1]
        batches = {r[0]: (r[1], r[2]) for r in c.execute(text("select id, created, started from batches"))}
    gateway, batcher, worker = [], [], []
    for (t0, _, _), (created, bid) in zip(through, reqs, strict=True):
        b_created, b_started = batches.get(bid, (None, None))
        gateway.append(created - t0)
        if b_created:
            batcher.append(b_created - created)
            if b_started:
                worker.append(b_started - b_created)
    return {"direct TTFT p50": _ms([f - t for t, f, _ in direct]), "direct e2e p50": _ms([e - t for t, _, e in direct]),
            "cohort TTFT p50": _ms([f - t for t, f, _ in through]), "cohort e2e p50": _ms([e - t for t, _, e in through]),
            "send -> record (gateway)": _ms(gateway), "record -> batch (batcher)": _ms(batcher),
            "batch -> started (Celery, admission)": _ms(worker)}


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    pairs = dict(p.split("=", 1) for p in sys.argv[4:])
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), pairs), indent=1))
