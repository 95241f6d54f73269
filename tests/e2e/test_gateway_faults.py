"""Faults in gateway streaming (COHORT_UPSTREAM_STREAMING=gateway) under load, with the `openai`
SDK streaming completions from two simulated engines (`cohort engine-sim`, fixed delays): the active
batcher killed with -9 while a standby waits, and the stack's Redis (the embedded one, with its
append-only file) killed with -9 and started again on the same port.

What each must hold: every request the gateway accepted (its stream began) is answered whole —
none lost (a stream that ends without its finish reason, a connection reset, no answer before the
client's deadline), none failed, so no 5xx — and recorded `done` in the log DB with the tokens its
client got; a request sent while Redis is down is served once it is back or refused with an
OpenAI-style 503 that says to retry; with the batcher gone, every request is accepted and answered;
the stack serves the requests sent after the fault; no log-DB row is left `queued` or `running`.
"""

from __future__ import annotations

import asyncio
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import httpx
import openai
import pytest
from openai import AsyncOpenAI

from bench.front_bench import cohort_processes, fixed_delay_engines
from cohort import bus
from cohort.protocol import FailureCode
from procstack.embedded_redis import EmbeddedRedis
from tests.e2e.stack import TestStack

pytestmark = pytest.mark.e2e
MODEL = "cohort/tiny-random-llama"
TOKENS = 150               # ~0.6 s a stream at 4 ms a token: a fault always finds rows streaming
CLIENT_DEADLINE_S = 45.0   # past this a request counts as hung (the stack's own timeout is shorter)
STACK_ENV = {"COHORT_UPSTREAM_STREAMING": "gateway", "COHORT_UPSTREAM_TIMEOUT_S": "5",
             "COHORT_REQUEST_TIMEOUT_S": "35", "COHORT_HTTP_ACCESS_LOG": "false"}


@dataclass
class Outcome:
    """What one client saw: a whole answer, an explicit error (with its HTTP status; for an SSE error
    event after the 200, the status its code stands for), or nothing usable (``lost``)."""

    rid: str | None = None
    tokens: int = 0
    finish: str | None = None
    status: int | None = None
    error: str | None = None
    lost: str | None = None
    took_s: float = 0.0
    accepted: bool = False  # the gateway answered 200: the stream began

    @property
    def whole(self) -> bool:
        return self.lost is None and self.error is None and self.finish == "length" and self.tokens == TOKENS


async def _one(client: AsyncOpenAI, i: int) -> Outcome:
    out, t0 = Outcome(), time.monotonic()

    async def read() -> None:
        stream = await client.completions.create(model=MODEL, prompt=f"Item {i}.", max_tokens=TOKENS, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        out.accepted = True
        async for ch in stream:
            out.rid = out.rid or ch.id.removeprefix("cmpl-")
            if ch.choices and ch.choices[0].finish_reason:
                out.finish = ch.choices[0].finish_reason
            if ch.usage:
                out.tokens = ch.usage.completion_tokens

    try:
        await asyncio.wait_for(read(), CLIENT_DEADLINE_S)
        if out.finish is None:
            out.lost = "the stream ended without a finish reason"
    except asyncio.TimeoutError:
        out.lost = f"no answer in {CLIENT_DEADLINE_S:.0f} s"
    except openai.APIStatusError as e:
        out.status, out.error = e.status_code, _message(e.body) or "(no message)"
    except openai.APIConnectionError as e:
        out.lost = f"connection: {e!r}"
    except openai.APIError as e:  # an SSE error event after the 200: the status its code stands for
        out.error = _message({"error": e.body}) or "(no message)"
        out.status = FailureCode.parse(e.body.get("code") if isinstance(e.body, dict) else None).http_status
    out.took_s = time.monotonic() - t0
    return out


def _message(body: object) -> str | None:
    err = body.get("error", body) if isinstance(body, dict) else None
    return err.get("message") if isinstance(err, dict) else None


async def _load(url: str, n: int, gap_s: float, fault: Callable[[], None] | None = None,
                fault_after: int = 0) -> list[Outcome]:
    """``n`` streaming requests, one every ``gap_s``; ``fault`` runs (in a thread) after the
    ``fault_after``-th is sent, while the others keep coming."""
    client = AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=CLIENT_DEADLINE_S + 5)
    tasks, faulting = [], None
    for i in range(n):
        if fault is not None and i == fault_after:
            faulting = asyncio.ensure_future(asyncio.to_thread(fault))
        tasks.append(asyncio.ensure_future(_one(client, i)))
        await asyncio.sleep(gap_s)
    try:
        if faulting is not None:
            await faulting
        return list(await asyncio.gather(*tasks))
    finally:
        await client.close()


def _check(outcomes: list[Outcome]) -> None:
    """Every request the gateway accepted (its stream began) answered whole: none lost, none failed;
    one it did not accept refused with an explicit error, never a 5xx but the 503 that says "retry"
    (Redis, or the pool's instances, not back yet)."""
    lost = [o for o in outcomes if o.lost]
    assert not lost, f"{len(lost)} of {len(outcomes)} lost: {lost[:3]}"
    failed = [o for o in outcomes if o.accepted and not o.whole]
    assert not failed, f"{len(failed)} accepted request(s) not answered whole: {failed[:3]}"
    refused = [o for o in outcomes if not o.accepted]
    assert all(o.error and o.status is not None and (o.status < 500 or o.status == 503) for o in refused), refused


def _unfinished(db: Path) -> list[tuple[str, str]]:
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT id, status FROM requests WHERE status IN ('queued', 'running')").fetchall()
    finally:
        con.close()


def _records(db: Path, outcomes: list[Outcome]) -> dict[str, tuple[str, int | None]]:
    """The log DB's (status, tokens) of the requests the clients got an id for."""
    rids = [o.rid for o in outcomes if o.rid]
    con = sqlite3.connect(db)
    try:
        marks = ",".join("?" * len(rids))
        return {rid: (status, tokens) for rid, status, tokens in con.execute(
            f"SELECT id, status, actual_tokens FROM requests WHERE id IN ({marks})", rids)}
    finally:
        con.close()


def _check_records(db: Path, outcomes: list[Outcome]) -> None:
    """Every whole answer is recorded done with the tokens its client got (the worker counts them
    from its gateway's reports: one lost or taken out of order leaves the count short)."""
    records = _records(db, outcomes)
    wrong = {o.rid: records.get(o.rid) for o in outcomes if o.whole and records.get(o.rid) != ("done", TOKENS)}
    assert not wrong, f"log DB disagrees with what {len(wrong)} client(s) got: {wrong}"


def _settled(db: Path, timeout_s: float = 30.0) -> list[tuple[str, str]]:
    """The log DB's rows still ``queued`` or ``running`` once the workers had ``timeout_s`` to
    write their ends (they write after the client got its answer)."""
    deadline = time.time() + timeout_s
    while (left := _unfinished(db)) and time.time() < deadline:
        time.sleep(0.5)
    return left


class RestartableRedis:
    """The embedded Redis of `cohort serve`, killed with -9 and started again on its port and data
    folder: what it had written is read back from its append-only file. The same port, because
    every process of the stack has it in its COHORT_REDIS_URL."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.server = EmbeddedRedis(folder)
        self.url = self.server.url

    def kill(self) -> None:
        (proc,) = cohort_processes(self.url)["redis"]
        proc.kill()
        proc.wait(10)

    def start(self) -> None:
        with mock.patch("procstack.embedded_redis.free_port", return_value=self.server.port):
            self.server = EmbeddedRedis(self.folder)

    def close(self) -> None:
        self.server.close()


@pytest.fixture(scope="module")
def faults_stack(tmp_path_factory, request) -> Iterator[tuple[TestStack, RestartableRedis, list[str]]]:
    """One gateway-streaming stack in front of two engines, on an embedded Redis the tests may
    restart; its processes' log tails are printed when a test failed. Each test leaves it serving."""
    folder = tmp_path_factory.mktemp("faults")
    with fixed_delay_engines(2, 5.0, 4.0, folder) as engines:
        redis_server = RestartableRedis(folder / "redis")
        with mock.patch("tests.e2e.stack.redis_url_for_test", return_value=(redis_server.url, redis_server.close)):
            stack = TestStack(folder / "stack", COHORT_UPSTREAMS=",".join(url for _, url in engines), **STACK_ENV)
        try:
            stack.start()
            yield stack, redis_server, [url for _, url in engines]
        finally:
            stack.stop()  # closes redis_server too (the stack's Redis closer)
            if request.session.testsfailed:
                for name in stack.procs:
                    print(stack.tail(name, 40))


def _holder(stack: TestStack) -> str | None:
    """Who holds the pool's batcher lock: ``host-pid`` of the active batcher."""
    return stack.redis.get(bus.pool_keys("default").batcher_lock)


def _generated(engines: list[str]) -> float:
    """Tokens the engines generated so far (their /metrics)."""
    return sum(float(v) for url in engines for v in re.findall(
        r"^vllm:generation_tokens_total(?:\{[^}]*\})? (\S+)$",
        httpx.get(url.removesuffix("/v1") + "/metrics", timeout=10).text, re.M))


def _summary(what: str, outcomes: list[Outcome], engines: list[str], tokens_before: float) -> None:
    """What the clients saw, for the log: answers, errors, latencies, and the tokens the engines
    generated beyond the answers (rows run twice)."""
    extra = _generated(engines) - tokens_before - TOKENS * sum(o.whole for o in outcomes)
    print(f"{what}: {sum(o.whole for o in outcomes)} whole of {len(outcomes)}, errors "
          f"{[(o.status, o.error) for o in outcomes if o.error]}, latencies {[round(o.took_s, 1) for o in outcomes]}, "
          f"{extra:.0f} tokens generated beyond the answers")


def test_a_killed_batcher_is_replaced_by_its_standby_and_loses_nothing(faults_stack):
    stack, _, engines = faults_stack
    tokens_before = _generated(engines)
    standby = stack.spawn("batcher-standby", "batcher")
    time.sleep(1.5)  # the standby is up and waiting on the lock
    assert standby.poll() is None and _holder(stack).endswith(f"-{stack.procs['batcher'].pid}")

    # 24 requests over 2.4 s: the first 12 streaming or queued when the batcher dies, the other 12
    # sent after it died, waiting for the standby to take the lock (its TTL) and then them
    outcomes = asyncio.run(_load(stack.url, 24, 0.1, lambda: stack.kill("batcher"), 12))
    _check(outcomes)
    assert all(o.whole for o in outcomes)  # the gateway admits without the batcher: none refused
    assert _holder(stack).endswith(f"-{standby.pid}") and "active" in stack.tail("batcher-standby")
    after = asyncio.run(_load(stack.url, 8, 0.05))  # the standby, now active, serves at once
    _check(after)
    assert max(o.took_s for o in after) < 5
    assert not _settled(stack.db_path)
    assert len({o.rid for o in [*outcomes, *after]}) == 32
    _check_records(stack.db_path, [*outcomes, *after])
    _summary("batcher killed", [*outcomes, *after], engines, tokens_before)
    stack.restart("batcher")  # the killed one comes back, as the standby now


def test_a_redis_restart_mid_load_fails_nothing_silently(faults_stack):
    stack, redis_server, engines = faults_stack
    stack.wait_healthy(60)
    tokens_before = _generated(engines)

    def restart() -> None:
        redis_server.kill()
        time.sleep(2.0)
        redis_server.start()

    # 24 requests over 2.4 s, Redis killed after the 12th and down for 2 s: the ones it had accepted
    # end, whole or with an explicit error; the ones sent while it is down wait for it or are refused
    outcomes = asyncio.run(_load(stack.url, 24, 0.1, restart, 12))
    _check(outcomes)
    stack.wait_healthy(30)
    after = asyncio.run(_load(stack.url, 8, 0.05))
    _check(after)
    assert not _settled(stack.db_path)
    _check_records(stack.db_path, [*outcomes, *after])
    _summary("Redis restarted", [*outcomes, *after], engines, tokens_before)
