"""Several gateway processes on one port (COHORT_GATEWAY_PROCESSES=2) in front of a simulated
engine (the fixed-delay `cohort engine-sim`): every request answered whichever process takes it,
/metrics counting each request once whichever process answers the scrape, and a gateway process
killed with -9 while its streams are open: the other serves on, the dead one is started again,
and nothing it had accepted stays unanswered in the log DB."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sqlite3
import time

import httpx
import psutil
import pytest
from openai import APIConnectionError, AsyncOpenAI

from bench.front_bench import fixed_delay_engines
from tests.e2e.stack import TestStack

pytestmark = pytest.mark.e2e
MODEL = "cohort/tiny-random-llama"


@pytest.fixture(scope="module")
def two_gateways(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gateways")
    with fixed_delay_engines(1, 5.0, 2.0, folder) as [(_, url)]:
        stack = TestStack(folder / "stack", COHORT_UPSTREAMS=url, COHORT_GATEWAY_PROCESSES="2",
                          COHORT_HTTP_ACCESS_LOG="false")
        try:
            stack.start()
            yield stack
        finally:
            stack.stop()


def _gateway_children(stack: TestStack) -> list[psutil.Process]:
    """The gateway's serving processes (uvicorn's children; not its resource tracker)."""
    out = []
    for p in psutil.Process(stack.procs["gateway"].pid).children():
        try:  # a killed one is a zombie until its parent reaps it: not serving
            if p.status() != psutil.STATUS_ZOMBIE and "multiprocessing.resource_tracker" not in " ".join(p.cmdline()):
                out.append(p)
        except psutil.Error:
            continue
    return out


def _served(stack: TestStack) -> float:
    text = httpx.get(f"{stack.url}/metrics", timeout=30).text
    return sum(float(v) for v in re.findall(r'^cohort_requests_total\{endpoint="completions",status="200"\} (\S+)$',
                                            text, re.M))


async def _send(stack: TestStack, n: int, max_tokens: int = 8) -> list:
    client = AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="none", max_retries=0, timeout=120)
    return await asyncio.gather(*(client.completions.create(model=MODEL, prompt=f"Count to {i}.", max_tokens=max_tokens,
                                                            extra_body={"ignore_eos": True}) for i in range(n)),
                                return_exceptions=True)


def test_two_processes_answer_and_metrics_count_each_request_once(two_gateways):
    stack = two_gateways
    assert len(_gateway_children(stack)) == 2
    before = _served(stack)
    answers = asyncio.run(_send(stack, 40))
    assert all(not isinstance(a, Exception) for a in answers), [a for a in answers if isinstance(a, Exception)][:3]
    assert {a.usage.completion_tokens for a in answers} == {8}
    # each scrape is answered by either process: every one adds up both processes' counts
    assert [_served(stack) - before for _ in range(4)] == [40.0] * 4


def test_a_gateway_process_killed_mid_stream_leaves_nothing_unanswered(two_gateways):
    stack = two_gateways
    victim = _gateway_children(stack)[0]

    async def scenario():
        long = asyncio.ensure_future(_send(stack, 12, max_tokens=400))  # ~1 s streams on both processes
        await asyncio.sleep(0.5)
        os.kill(victim.pid, signal.SIGKILL)
        return await long

    answers = asyncio.run(scenario())
    # which process accepted which connection is the kernel's choice: the victim's streams end
    # with a connection error at once (none hangs), the other's complete
    assert all(isinstance(a, APIConnectionError) or a.usage.completion_tokens == 400 for a in answers), answers
    after = asyncio.run(_send(stack, 20))  # the port keeps serving while the dead process is replaced
    assert all(not isinstance(a, Exception) for a in after), [a for a in after if isinstance(a, Exception)][:3]
    deadline = time.time() + 60
    while time.time() < deadline and len(_gateway_children(stack)) < 2:
        time.sleep(0.5)
    assert len(_gateway_children(stack)) == 2 and victim.pid not in {p.pid for p in _gateway_children(stack)}
    con = sqlite3.connect(stack.db_path)
    deadline = time.time() + 60
    while time.time() < deadline and con.execute(
            "SELECT count(*) FROM requests WHERE status IN ('queued', 'running')").fetchone()[0]:
        time.sleep(0.5)
    assert con.execute("SELECT count(*) FROM requests WHERE status IN ('queued', 'running')").fetchone()[0] == 0
