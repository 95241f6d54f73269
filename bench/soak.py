"""`cohort bench soak`: `make serve`'s stack under steady mixed OpenAI traffic for M minutes.

Why: a 24-minute soak answered everything, yet one admin retrain let continuous
learning take a core for the rest of the run (median latency 1–3 s → 40–50 s) while var/ and
Redis grew without bound. A soak shows what a short benchmark cannot: drift. It starts the stack
as `cohort serve` does (embedded Redis with its maxmemory policy, worker, batcher, gateway,
learning worker, beat; SQLite log DB; its own folder), sends an open-loop Poisson stream of
requests at ``rate`` — chat completions (plain, streamed, n=2), completions, generate with
emulated lengths (what the predictor learns from), ``leave_frac`` clients that leave mid-stream
and ``bad_frac`` bad bodies — asks for an admin retrain of both models early on, and samples
every ``sample_s``: RSS and CPU per process, Redis memory, the data folder's size, log-DB rows,
stream keys. It reports 5xx, lost requests (no HTTP answer) and p50/p99 per window, and draws
the curves.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets
import shutil
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import psutil
import redis
from sqlalchemy import func, select

from bench.soak_stats import (
    Outcome,
    engine_windows,
    first_last,
    key_family,
    last_window,
    resource_trends,
    steadiness,
    summarize,
    windows,
)
from cohort import bus, engine_counters
from cohort.logdb import get_db_engine, log_counts, requests
from procstack.embedded_redis import EmbeddedRedis
from procstack.stack import Stack, free_port


@dataclass
class SoakConfig:
    minutes: float = 20.0
    rate: float = 4.0
    warmup_s: float = 60.0            # first part left out of the "after warm-up" figures
    window_s: float = 60.0            # p50/p99 per window of this length (by send time)
    sample_s: float = 10.0            # resource samples
    leave_frac: float = 0.05
    bad_frac: float = 0.02
    max_tokens: int = 32
    retrain_at_s: float | None = 30.0  # admin retrain of both models (None: none)
    retrain_every_s: float | None = None  # keep retraining (a learner under stress), for the on/off bench
    learning: bool = True              # learning worker + beat, as `make serve`
    seed: int = 0
    drain_s: float = 120.0             # after the last request is sent, how long answers may take
    server_env: dict[str, str] = field(default_factory=dict)
    models_from: str | None = None     # a `var/models` folder copied in before the stack starts


def pick_kind(rng: random.Random, leave_frac: float, bad_frac: float) -> str:
    """The mix: bad and leaving clients at their fractions, the rest spread over the API."""
    u = rng.random()
    if u < bad_frac:
        return "bad"
    if u < bad_frac + leave_frac:
        return "leave"
    return rng.choices(("chat", "chat_stream", "chat_n2", "completion", "generate"), (30, 25, 5, 10, 30))[0]


BAD_BODIES = (b"{not json", b'{"messages": [], "max_tokens": 8}', b'{"messages": [{"role": "user", "content": "x"}], '
              b'"max_tokens": -3}', b'{"prompt": 7, "max_tokens": "many"}', b"[]")


async def one_request(client: httpx.AsyncClient, kind: str, i: int, rng: random.Random, max_tokens: int,
                      out: Outcome, model: str) -> None:
    """Send one request of ``kind`` and fill ``out`` (status, latency, stream errors)."""
    words = " ".join(rng.choice(("sea", "waves", "code", "bread", "stars", "rain")) for _ in range(rng.randint(3, 40)))
    mt = rng.randint(4, max_tokens)
    msgs = [{"role": "user", "content": f"#{i}: tell me about {words}"}]
    t0 = time.perf_counter()
    if kind == "bad":
        r = await client.post(rng.choice(("/v1/chat/completions", "/v1/completions")), content=rng.choice(BAD_BODIES),
                              headers={"content-type": "application/json"})
        out.status = r.status_code
    elif kind in ("chat_stream", "leave"):
        body = {"model": model, "messages": msgs, "max_tokens": max(mt, 12) if kind == "leave" else mt, "stream": True}
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            out.status = r.status_code
            chunks = 0
            async for line in r.aiter_lines():
                out.stream_error |= line.startswith("data: ") and '"error"' in line[:20]
                chunks += line.startswith("data: ")
                if kind == "leave" and chunks >= 3:
                    break  # the client goes away mid-stream: the connection closes here
    elif kind == "generate":
        r = await client.post("/v1/generate", json={"instruction": "Describe.", "input": words, "max_tokens": max_tokens,
                                                    "emulated_tokens": min(max_tokens, 2 + len(words) // 12)})
        out.status = r.status_code
    elif kind == "completion":
        r = await client.post("/v1/completions", json={"model": model, "prompt": f"#{i} {words}", "max_tokens": mt})
        out.status = r.status_code
    else:
        r = await client.post("/v1/chat/completions", json={"model": model, "messages": msgs, "max_tokens": mt,
                                                            "n": 2 if kind == "chat_n2" else 1})
        out.status = r.status_code
    out.latency = time.perf_counter() - t0


class Sampler:
    """Resource samples of a running stack: RSS/CPU per process, Redis memory, disk, log rows."""

    def __init__(self, stack: Stack, redis_url: str, data_dir: Path, db_url: str) -> None:
        self.stack, self.data_dir, self.db_url = stack, data_dir, db_url
        self.redis = redis.Redis.from_url(redis_url, decode_responses=True)
        self.procs: dict[str, psutil.Process] = {}
        self.samples: list[dict[str, Any]] = []
        self._host = psutil.cpu_times()

    def _steal_pct(self) -> float | None:
        """The host's CPU time the hypervisor gave to other guests since the last sample, as a share
        of all CPU time (Linux ``steal``; None elsewhere). A VM whose CPUs are stolen runs every
        process slower at the same CPU%: latency then moves without anything in the stack changing."""
        now = psutil.cpu_times()
        before, self._host = self._host, now
        if not hasattr(now, "steal"):
            return None
        total = sum(now) - sum(before)
        return round(100.0 * (now.steal - before.steal) / total, 1) if total > 0 else 0.0

    def _proc(self, name: str, pid: int) -> psutil.Process:
        p = self.procs.get(name)
        if p is None or p.pid != pid:
            p = self.procs[name] = psutil.Process(pid)
            p.cpu_percent(None)  # the first reading is 0: it starts the interval
        return p

    def sample(self, t: float) -> dict[str, Any]:
        rss, cpu, threads = {}, {}, {}
        for name, popen in self.stack.procs.items():
            try:
                p = self._proc(name, popen.pid)
                family = [p, *p.children(recursive=True)]
                rss[name] = sum(q.memory_info().rss for q in family) / 2**20
                cpu[name] = sum(q.cpu_percent(None) for q in family)
                if name == "gateway":
                    threads = thread_cpu_s(p)
            except psutil.Error:
                continue
        info = self.redis.info("memory")
        prefixes = key_prefix_counts(self.redis)
        keys = bus.pool_keys("default")
        engines = {k: json.loads(v) for k, v in self.redis.hgetall(engine_counters.ENGINE_STATS).items()}
        s = {"t": round(t, 1), "rss_mb": rss, "cpu_pct": cpu, "host_steal_pct": self._steal_pct(),
             "gateway_thread_cpu_s": threads,
             "redis_used_mb": info["used_memory"] / 2**20,
             "engines": engines, "queued": self.redis.llen(keys.incoming) + self.redis.hlen(keys.pending),
             "redis_dataset_mb": info.get("used_memory_dataset", 0) / 2**20, "redis_keys": prefixes,
             "stream_keys": prefixes.get("cohort:stream", 0), "data_dir_mb": du_mb(self.data_dir), "log_rows": log_counts(get_db_engine(self.db_url))}
        self.samples.append(s)
        return s


def thread_cpu_s(p: psutil.Process) -> dict[str, float]:
    """CPU seconds so far of each of the process's threads, by native thread id: when a process's CPU
    climbs, the thread whose share climbs names the cause (a sampler's stacks cannot see native
    threads or the garbage collector). ``py-spy dump`` maps the ids to Python thread names."""
    return {str(th.id): round(th.user_time + th.system_time, 2) for th in p.threads()}


def key_prefix_counts(r: redis.Redis) -> dict[str, int]:
    """Keys by family (``bench.soak_stats.key_family``): what grows when Redis memory grows."""
    return dict(Counter(key_family(str(key)) for key in r.scan_iter(count=1000)))


def du_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def start_stack(cfg: SoakConfig, folder: Path, token: str, redis_maxmemory_mb: int = 512):
    """`cohort serve`'s processes in ``folder`` (embedded Redis, SQLite, learning + beat)."""
    redis_srv = EmbeddedRedis(folder / "redis", maxmemory_mb=redis_maxmemory_mb)
    port = free_port()
    data_dir = folder / "var"
    db_url = f"sqlite:///{data_dir / 'cohort.db'}"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "COHORT_EMULATE_LENGTHS": "true",
           "COHORT_ADMIN_TOKEN": token, **cfg.server_env, "COHORT_REDIS_URL": redis_srv.url,
           "COHORT_DATA_DIR": str(data_dir), "COHORT_DATABASE_URL": db_url}
    if cfg.models_from:  # start from trained versions (the learning A/B's two sides alike)
        shutil.copytree(cfg.models_from, data_dir / "models", dirs_exist_ok=True)
    stack = Stack(env, f"http://127.0.0.1:{port}", log_dir=folder / "logs")
    try:
        stack.start_core("127.0.0.1", port, learning=cfg.learning)
        if cfg.learning:
            stack.spawn("beat", "worker", "beat", "--schedule-file", str(data_dir / "celerybeat-schedule"))
        stack.wait_healthy(600)
    except BaseException:
        stack.stop()
        redis_srv.close()
        raise
    return stack, redis_srv, data_dir, db_url


def prime_models(cfg: SoakConfig, folder: Path, timeout_s: float = 1200.0) -> Path:
    """Train both models once, on a stack of their own with no traffic, and return its
    ``var/models``. Why: a fresh stack predicts cold (max_tokens, no encoder) until its first
    retrain; an A/B whose "off" side never retrains would compare "no predictor" with "a
    predictor plus a learner" — the gateway's per-request encoder, not the learner. Both sides
    start from a copy of these versions, so "on" differs only by the learner's work."""
    token = secrets.token_urlsafe(16)
    stack, redis_srv, data_dir, _ = start_stack(replace(cfg, learning=True), folder, token)
    try:
        with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {token}"}, timeout=30.0) as client:
            ids = {t: client.post("/admin/retrain", json={"target": t}).json()["task_id"] for t in ("predictor", "estimator")}
            deadline = time.monotonic() + timeout_s
            for target, task_id in ids.items():
                while (st := client.get(f"/admin/tasks/{task_id}").json())["state"] not in ("SUCCESS", "FAILURE"):
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"priming: the {target} retrain did not end in {timeout_s:.0f} s")
                    time.sleep(2.0)
                if st["state"] != "SUCCESS":
                    raise RuntimeError(f"priming: the {target} retrain failed: {st.get('error')}")
    finally:
        stack.stop()
        redis_srv.close()
    if not (data_dir / "models" / "predictor" / "ACTIVE").exists():
        raise RuntimeError("priming: no active predictor version after the retrain")
    return data_dir / "models"


async def _retrain(client: httpx.AsyncClient, headers: dict[str, str], log: list[dict[str, Any]], t: float) -> None:
    for target in ("predictor", "estimator"):
        r = await client.post("/admin/retrain", json={"target": target}, headers=headers)
        log.append({"t": round(t, 1), "target": target, "status": r.status_code,
                    "task_id": r.json().get("task_id") if r.status_code == 202 else None})


async def drive(cfg: SoakConfig, url: str, sampler: Sampler, token: str,
                progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Send the traffic, retrain, sample; return the report (without the stack's final state)."""
    rng = random.Random(cfg.seed)
    outcomes: list[Outcome] = []
    tasks: set[asyncio.Task] = set()  # in flight only: a finished one drops out (the list grew all run)
    retrains: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {token}"}
    # idle connections expire before the server's 5 s keep-alive: one reused as the server closes it is a ReadError
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256, keepalive_expiry=2.0)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(660.0, connect=30.0), limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        end = t0 + cfg.minutes * 60.0
        next_send, next_sample = t0, t0
        next_retrain = t0 + cfg.retrain_at_s if cfg.retrain_at_s is not None else math.inf
        i = 0
        while (now := time.perf_counter()) < end:
            if now >= next_sample:
                s = await asyncio.to_thread(sampler.sample, now - t0)
                next_sample += cfg.sample_s
                if progress:
                    w = last_window(outcomes, cfg.window_s)
                    progress(f"t={s['t']:.0f}s sent={len(outcomes)} p50={w.get('p50_s')} redis={s['redis_used_mb']:.1f}MB "
                             f"var={s['data_dir_mb']:.1f}MB cpu={ {k: round(v) for k, v in s['cpu_pct'].items()} }")
            if now >= next_retrain:
                await _retrain(client, headers, retrains, now - t0)
                next_retrain = now + cfg.retrain_every_s if cfg.retrain_every_s else math.inf
            while next_send <= now:
                o = Outcome(pick_kind(rng, cfg.leave_frac, cfg.bad_frac), sent=next_send - t0)
                outcomes.append(o)
                task = asyncio.create_task(_guarded(client, o, i, random.Random(rng.random()), cfg.max_tokens, model))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
                i += 1
                next_send += rng.expovariate(cfg.rate)
            await asyncio.sleep(min(0.05, max(0.0, next_send - time.perf_counter())))
        sent_wall = time.perf_counter() - t0
        _, pending = await asyncio.wait(set(tasks), timeout=cfg.drain_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        sampler.sample(time.perf_counter() - t0)
        for r in retrains:  # how each admin retrain ended (a failed read is reported, never ends the soak)
            if r["task_id"]:
                st = await _task_state(client, headers, r["task_id"])
                r["state"] = st.get("state")
                r["retrained"] = (st.get("result") or {}).get("retrained")
    end_s = cfg.minutes * 60.0  # when sending stopped, on the soak's own clock
    return {"summary": summarize(outcomes, warmup_s=cfg.warmup_s, end_s=end_s, wall_s=sent_wall),
            "windows": windows(outcomes, cfg.window_s),
            "engine_windows": engine_windows(sampler.samples, cfg.window_s),
            "latency_first_last": first_last(outcomes, warmup_s=cfg.warmup_s, end_s=end_s),
            "retrains": retrains, "samples": sampler.samples, "undrained": len(pending)}


async def _task_state(client: httpx.AsyncClient, headers: dict, task_id: str, tries: int = 3) -> dict:
    """An admin task's state; a connection the server closed as it was reused (ReadError) is tried
    again, and after ``tries`` the error itself is the state, so the soak's results are kept."""
    for attempt in range(tries):
        try:
            return (await client.get(f"/admin/tasks/{task_id}", headers=headers)).json()
        except (httpx.HTTPError, ValueError) as e:
            if attempt == tries - 1:
                return {"state": f"unread: {type(e).__name__}"}
            await asyncio.sleep(0.5)
    return {}


async def _guarded(client: httpx.AsyncClient, o: Outcome, i: int, rng: random.Random, max_tokens: int,
                   model: str) -> None:
    try:
        await one_request(client, o.kind, i, rng, max_tokens, o, model)
    except (httpx.HTTPError, OSError) as e:
        if o.kind == "leave" and o.status == 200:
            return  # the leaving client closed it itself
        # which error, and whether a status had arrived (a stream broken after its 200)
        o.error = f"{type(e).__name__}{' after ' + str(o.status) if o.status else ''}"
        o.status = None  # no (whole) HTTP answer: lost


def run_soak(cfg: SoakConfig, workdir: Path, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Start the stack, drive it, stop it; the report also holds the stack's final state."""
    workdir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(16)
    stack, redis_srv, data_dir, db_url = start_stack(cfg, workdir, token)
    try:
        sampler = Sampler(stack, redis_srv.url, data_dir, db_url)
        report = asyncio.run(drive(cfg, stack.url, sampler, token, progress))
        report["dead_processes"] = stack.dead()
        report["open_records"] = _open_records(db_url)
        report["versions"] = {t: sorted(p.name for p in (data_dir / "models" / t).glob("v*"))
                              for t in ("predictor", "estimator")}
        r = redis.Redis.from_url(redis_srv.url)
        report["redis"] = {"maxmemory_policy": r.config_get("maxmemory-policy")["maxmemory-policy"],
                           "maxmemory_mb": int(r.config_get("maxmemory")["maxmemory"]) / 2**20}
    finally:
        stack.stop()
        redis_srv.close()
    report["trends"] = resource_trends(report["samples"], cfg.warmup_s)
    report["steadiness"] = steadiness(report["windows"], engine_windows_=report["engine_windows"])
    report["config"] = asdict(cfg)
    return report


def _open_records(db_url: str) -> int:
    with get_db_engine(db_url).connect() as conn:
        return int(conn.execute(select(func.count()).select_from(requests).where(requests.c.status == "queued")).scalar())
