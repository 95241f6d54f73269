"""A local cohort stack as separate processes: used by `cohort serve`, the end-to-end tests and
the live benchmark (one fresh stack per policy).

Each part is `python -m launch.cli <role>` with the stack's environment: the entry point is
named, never imported, so this floor sits below both `launch` (which serves with it) and `bench`
(which benchmarks with it). Logs go to the terminal, or to ``<log_dir>/<name>.log`` when a
folder is given (tests print their tails).
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import httpx

log = logging.getLogger("cohort.stack")


def free_port() -> int:
    """A TCP port free on the loopback interface now (the caller binds it soon after)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_ok(url: str, timeout_s: float, check: Callable[[], None] = lambda: None,
                  accept: Callable[[httpx.Response], bool] = lambda r: True) -> bool:
    """Poll ``GET url`` until it answers 200 and ``accept`` takes the answer (True) or ``timeout_s``
    passes (False); ``check`` runs before each try and raises to stop early (a process that died)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        check()
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200 and accept(r):
                return True
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    return False


class Stack:
    """Processes of one stack; ``url`` is where its gateway answers."""

    def __init__(self, env: Mapping[str, str], url: str, log_dir: Path | None = None) -> None:
        self.env = dict(env)
        self.url = url
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen] = {}
        self.args: dict[str, tuple[str, ...]] = {}
        self.extra_env: dict[str, dict[str, str]] = {}
        if log_dir:
            log_dir.mkdir(parents=True, exist_ok=True)

    def spawn(self, name: str, *args: str, env: Mapping[str, str] | None = None) -> subprocess.Popen:
        """Start ``cohort <args>`` as process ``name``; ``env`` adds variables for this one alone."""
        out = open(self.log_dir / f"{name}.log", "ab") if self.log_dir else None  # closed with the process
        extra = dict(env or {})
        p = subprocess.Popen([sys.executable, "-m", "launch.cli", *args], env={**self.env, **extra}, stdout=out,
                             stderr=subprocess.STDOUT if out else None)
        self.procs[name] = p
        self.args[name] = args
        self.extra_env[name] = extra
        log.info("started %s (pid %d)", name, p.pid)
        return p

    def restart(self, name: str) -> subprocess.Popen:
        """Start a process that died again, with the same role and arguments."""
        return self.spawn(name, *self.args[name], env=self.extra_env.get(name))

    def upstreams(self) -> list[str]:
        """The upstream base URLs the stack fronts (COHORT_UPSTREAMS), in order."""
        return [u.strip() for u in self.env.get("COHORT_UPSTREAMS", "").split(",") if u.strip()]

    def start_core(self, host: str, port: int, learning: bool = False) -> Stack:
        """Worker, batcher and gateway: the request path (and the learning worker, which runs
        the retraining that /admin/retrain enqueues). With COHORT_UPSTREAMS, one upstream worker
        per URL instead of the built-in model worker."""
        for i, url in enumerate(self.upstreams()):
            self.spawn(f"upstream-{i}", "worker", env={"COHORT_UPSTREAM": url})
        if not self.upstreams():
            self.spawn("worker", "worker")
        if learning:
            self.spawn("learning", "worker", "learning")
        self.spawn("batcher", "batcher")
        self.spawn("gateway", "gateway", "--host", host, "--port", str(port))
        return self

    def dead(self) -> list[str]:
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def _check_alive(self) -> None:
        """Raise when a process of the stack has died (a wait then stops early, with its log)."""
        if dead := self.dead():
            raise RuntimeError(f"{dead[0]} exited with {self.procs[dead[0]].returncode}:\n" + self.tail(dead[0]))

    def wait_healthy(self, timeout_s: float = 600.0) -> None:
        """Until /health says ok (Redis up, an instance alive); raises if a process dies first."""
        if not wait_until_ok(f"{self.url}/health", timeout_s, self._check_alive):
            raise TimeoutError("stack not healthy:\n" + "\n".join(self.tail(n) for n in self.procs))

    def wait_instances(self, n: int, timeout_s: float = 600.0) -> None:
        """Until /health counts ``n`` live instances (extra workers register after the first)."""
        if not wait_until_ok(f"{self.url}/health", timeout_s, self._check_alive,
                             accept=lambda r: len(r.json().get("instances", [])) >= n):
            raise TimeoutError(f"fewer than {n} instances registered in {timeout_s:.0f} s")

    def tail(self, name: str, lines: int = 40) -> str:
        if not self.log_dir:
            return f"--- {name}: see the terminal ---"
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return f"--- {name} ---\n" + "\n".join(text[-lines:])

    def kill(self, name: str) -> None:
        """SIGKILL one process (failure drills)."""
        p = self.procs[name]
        p.send_signal(signal.SIGKILL)
        p.wait()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM everything, then SIGKILL what is still there after ``grace_s``."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.time() + grace_s
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in %.0f s; killing it", name, grace_s)
                p.kill()
                p.wait()
