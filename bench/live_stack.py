"""A fresh local stack per policy for live benchmarks: same workload, one server run each.

Each stack gets its own embedded Redis, SQLite log DB and data folder under ``workdir``, emptied
first, runs with length emulation on, and is stopped (every process) when the run is over. Emptied
because the folder holds what the stack learnt: the predictor's online correction, trained on an
earlier run's completions, made a later run's predictions better (log-length correlation 0.69 in
a stack's first run, 0.78–0.83 after), so a result depended on what had run there before.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from batcher.preemption import PREEMPTION_MODES
from bench.simulator import parse_policy, parse_run
from procstack.embedded_redis import EmbeddedRedis
from procstack.stack import Stack, free_port


def run_env(name: str) -> dict[str, str]:
    """The server settings a live run name asks for: ``POLICY[@EXECUTION[/RECOVERY]][:PREEMPTION]``
    (the simulator's naming, plus how an evicted row gives back its KV: recompute | swap |
    adaptive); without ``@`` the server's defaults."""
    name, _, preemption = name.partition(":")
    env: dict[str, str] = {}
    if preemption:
        if preemption not in PREEMPTION_MODES:
            raise ValueError(f"{preemption!r}: preemption must be one of {PREEMPTION_MODES}")
        env["COHORT_PREEMPTION"] = preemption
    base, oracle = parse_policy(name)
    if oracle:
        raise ValueError(f"{name!r}: live runs use the server's predictor; +oracle exists only in `bench sim`")
    env["COHORT_POLICY"] = base
    if "@" in name:
        ((_, execution, recovery),) = parse_run(name)
        env.update(COHORT_EXECUTION=execution, COHORT_OOM_RECOVERY=recovery)
    return env


def parse_env(pairs: list[str] | None) -> dict[str, str]:
    """KEY=VALUE pairs (``--server-env``) as a dict; a bad pair is a clear error."""
    out = {}
    for p in pairs or []:
        key, sep, value = p.partition("=")
        if not sep or not key:
            raise ValueError(f"--server-env wants KEY=VALUE, got {p!r}")
        out[key] = value
    return out


@contextmanager
def spawned_stack(policy: str, extra_env: Mapping[str, str], workdir: Path,
                  timeout_s: float = 600.0, workers: int = 1) -> Iterator[str]:
    """Start worker, batcher and gateway for the run ``policy`` names (``run_env``); yield the URL.
    ``workers`` > 1: more built-in worker processes in the pool, each its own instance."""
    folder = workdir / policy.replace("/", "_")
    shutil.rmtree(folder, ignore_errors=True)
    redis = EmbeddedRedis(folder / "redis")
    port = free_port()
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", **extra_env,
           **run_env(policy), "COHORT_EMULATE_LENGTHS": "true", "COHORT_REDIS_URL": redis.url,
           "COHORT_DATA_DIR": str(folder / "var"), "COHORT_DATABASE_URL": f"sqlite:///{folder / 'cohort.db'}"}
    stack = Stack(env, f"http://127.0.0.1:{port}", log_dir=folder / "logs")
    with sigterm_exits():
        try:
            stack.start_core("127.0.0.1", port)
            for i in range(1, workers):
                stack.spawn(f"worker-{i + 1}", "worker")
            stack.wait_healthy(timeout_s)
            if workers > 1:
                stack.wait_instances(workers, timeout_s)
            yield stack.url
        finally:
            stack.stop()
            redis.close()


def _exit(signum: int, _frame: object) -> None:
    signal.signal(signum, signal.SIG_IGN)  # a second one must not cut the cleanup short
    sys.exit(128 + signum)


@contextmanager
def sigterm_exits() -> Iterator[None]:
    """While a benchmark holds spawned stacks, SIGTERM (``kill``, a CI timeout) exits the way Ctrl-C
    does, through every ``finally``: without it the benchmark died and left its stack's gateway,
    batcher and Redis running, on the core the next run measures. Only the main thread can take a
    signal; elsewhere, and where a handler of the caller's own is set, nothing changes."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, _exit):
        yield
        return
    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
