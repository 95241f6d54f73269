"""How much of the machine the learning worker may take (COHORT_LEARNING__CPU_SHARE, COHORT_LEARNING__NICE).

Why: on a shared host a retrain competes with the LLM worker for the same cores. In a 24-minute
soak an unbounded learner took 80–88 % of a core for twenty minutes and the LLM worker fell from
~82 % to ~42 % CPU, so latency went from seconds to 40–50 s. Three layers, none needing root or
cgroups:

1. **threads**: torch, OpenMP and BLAS pools get ``max(1, floor(share × cores))`` threads (set in
   the environment before they are loaded — joblib's ``n_jobs=-1`` too, through
   LOKY_MAX_CPU_COUNT — and again with ``torch.set_num_threads`` and
   threadpoolctl around each retrain), so a fit never fans out over every core;
2. **nice**: the worker raises its nice value (19 by default), so the kernel gives a contended
   core to serving first; on an idle machine the learner still runs at full speed;
3. **duty cycle**: a small watcher process reads the worker's CPU time every 50 ms and, once it
   has used ``share × cores`` CPU-seconds in the current second, stops it (SIGSTOP) until the
   second is over, then continues it (SIGCONT). This caps the learner's average share even when
   nice alone would not (several idle-looking cores, or another tenant's processes at nice 0
   next to it). ``share = 1`` turns the duty cycle off.

The watcher exits when the worker goes away and always continues it before it exits, so a
stopped worker is never left behind.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import sys
import time
from collections.abc import Iterator

from threadpoolctl import threadpool_limits  # comes with scikit-learn; loads no BLAS itself

log = logging.getLogger(__name__)

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "TORCH_NUM_THREADS",
               "LOKY_MAX_CPU_COUNT")  # joblib (the random forests' n_jobs=-1) counts this many cores
PERIOD_S = 1.0
TICK_S = 0.05


def cores() -> int:
    """The cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def learner_threads(share: float, n_cores: int | None = None) -> int:
    """Threads a learner with ``share`` of ``n_cores`` may use: the floor, at least one."""
    return max(1, math.floor(share * (n_cores or cores())))


def limit_thread_env(threads: int) -> None:
    """Thread pools read these when first loaded: set them before torch/numpy BLAS start."""
    for var in THREAD_VARS:
        os.environ[var] = str(threads)


def lower_priority(increment: int) -> int:
    """Raise this process's nice value by ``increment``; returns the new nice value."""
    return os.nice(increment) if increment else os.nice(0)


@contextlib.contextmanager
def thread_limits(threads: int) -> Iterator[None]:
    """Around one retrain: torch's intra-op pool and every BLAS/OpenMP pool at ``threads``."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(threads)
    with threadpool_limits(limits=threads):
        yield


def _cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of ``pid`` (Linux /proc), in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        fields = f.read().rsplit(b")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def duty_cycle(pid: int, cpu_per_period_s: float, period_s: float = PERIOD_S, tick_s: float = TICK_S,
               parent_check: bool = True, until: float | None = None) -> int:
    """Keep ``pid`` under ``cpu_per_period_s`` CPU-seconds per ``period_s`` by stopping it for
    the rest of a period once it has used its budget. Runs until ``pid`` is gone (or is no longer
    this process's parent, with ``parent_check``), or until the time ``until``. Returns the number
    of periods in which it had to stop ``pid``."""
    stops = 0
    try:
        start, used0 = time.monotonic(), _cpu_seconds(pid)
        while until is None or time.monotonic() < until:
            time.sleep(tick_s)
            if parent_check and os.getppid() != pid:
                break
            now, used = time.monotonic(), _cpu_seconds(pid)
            if used - used0 >= cpu_per_period_s:
                rest = start + period_s - now
                if rest > 0:
                    os.kill(pid, signal.SIGSTOP)
                    stops += 1
                    try:
                        time.sleep(rest)
                    finally:
                        os.kill(pid, signal.SIGCONT)
            if time.monotonic() >= start + period_s or used - used0 >= cpu_per_period_s:
                start, used0 = time.monotonic(), _cpu_seconds(pid)
    except (ProcessLookupError, FileNotFoundError):
        pass  # the worker is gone
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    return stops


def start_duty_cycle(share: float, n_cores: int | None = None) -> int | None:
    """Fork the watcher for this process (call it before any thread starts); returns its pid,
    or None when ``share`` leaves nothing to cap (1.0) or the platform has no /proc."""
    n = n_cores or cores()
    if share >= 1.0 or not os.path.exists(f"/proc/{os.getpid()}/stat"):
        return None
    parent = os.getpid()
    child = os.fork()
    if child == 0:  # the watcher: no imports, no threads, only reads /proc and sends signals
        code = 0
        try:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the worker; the watcher follows it
            duty_cycle(parent, share * n * PERIOD_S)
        except BaseException:  # noqa: BLE001 - a child must never return into the parent's code
            code = 1
        os._exit(code)
    return child


def apply_cpu_share(share: float, nice: int) -> dict[str, int | float | None]:
    """Everything above, for the learning worker's process, before it loads torch or starts threads."""
    threads = learner_threads(share)
    limit_thread_env(threads)
    watcher = start_duty_cycle(share)  # forked first: the watcher keeps nice 0, so it is on time under load
    niceness = lower_priority(nice)
    log.info("learning worker: %d thread(s), nice %d, duty cycle %s (share %.2f of %d cores)", threads, niceness,
             f"pid {watcher}" if watcher else "off", share, cores())
    return {"threads": threads, "nice": niceness, "watcher_pid": watcher, "share": share, "cores": cores()}
