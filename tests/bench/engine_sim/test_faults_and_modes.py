"""Faults (die-after, stall, error-rate), the fixed-delay engine's timing, the roofline-timed
steps, and cohort's own upstream client probing the simulator as it probes vLLM."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import openai
import pytest

from bench.engine_sim.cpu_cost import free_port, spawn
from bench.engine_sim.roofline_steps import roofline_step_time
from bench.engine_sim.step_time import StepShape
from upstream.api import UpstreamServer, gauge


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="sim", max_retries=0, timeout=10)


class Died(ConnectionError):
    """What the in-process stand-in for os._exit raises: the handler dies, the connection is cut."""


def test_die_after_cuts_the_nth_request_mid_stream(sim) -> None:
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        raise Died

    with sim(die_after=2, ttft_ms=1.0, itl_ms=1.0, exit_fn=fake_exit) as s:
        c = client(s.url)
        assert c.completions.create(model="sim-model", prompt="a", max_tokens=5).usage.completion_tokens == 5
        got = []
        with pytest.raises((openai.APIError, Exception)):  # noqa: B017 - the SDK's error for a cut stream varies
            for ch in c.completions.create(model="sim-model", prompt="b", max_tokens=50, stream=True):
                got.append(ch)
    assert codes == [3] and 1 <= len(got) < 50


@pytest.mark.slow   # a Python process started: half a second
def test_die_after_exits_the_real_process() -> None:
    port = free_port()
    proc = spawn(["--ttft-ms", "1", "--itl-ms", "1", "--die-after", "1"], port)
    try:
        got = []
        with pytest.raises(Exception):  # noqa: B017 - a cut connection, whichever way httpx words it
            for ch in client(f"http://127.0.0.1:{port}/v1").completions.create(
                    model="sim-model", prompt="a", max_tokens=100, stream=True):
                got.append(ch)
        assert proc.wait(5) == 3 and len(got) >= 1
    finally:
        if proc.poll() is None:
            proc.kill()


def test_error_rate_answers_500_for_that_share_seeded(sim) -> None:
    def failures(seed: int) -> list[bool]:
        out = []
        with sim(error_rate=0.5, seed=seed, ttft_ms=0.0, itl_ms=0.0) as s:
            c = client(s.url)
            for _ in range(20):
                try:
                    c.completions.create(model="sim-model", prompt="x", max_tokens=1)
                    out.append(False)
                except openai.InternalServerError:
                    out.append(True)
        return out

    first = failures(7)
    assert first == failures(7) and 4 <= sum(first) <= 16
    with sim(error_rate=1.0) as s, pytest.raises(openai.InternalServerError):
        client(s.url).completions.create(model="sim-model", prompt="x", max_tokens=1)


@pytest.mark.slow  # 0.35 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_stall_after_holds_tokens_for_stall_s(sim) -> None:
    with sim(stall_after=1, stall_s=0.3, ttft_ms=1.0, itl_ms=1.0, speedup=1.0) as s:
        t0 = time.monotonic()
        r = client(s.url).completions.create(model="sim-model", prompt="x", max_tokens=3)
        took = time.monotonic() - t0
    assert r.usage.completion_tokens == 3 and 0.3 <= took < 1.5


def test_fixed_delay_timing(sim) -> None:
    with sim(ttft_ms=60.0, itl_ms=20.0, speedup=1.0) as s:
        stamps = []
        t0 = time.monotonic()
        for _ in client(s.url).completions.create(model="sim-model", prompt="x", max_tokens=4, stream=True):
            stamps.append(time.monotonic() - t0)
    assert 0.055 <= stamps[0] < 0.2
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    assert all(0.01 <= g < 0.1 for g in gaps) and 0.05 <= sum(gaps) < 0.2


def test_roofline_steps_set_the_inter_token_latency(sim) -> None:
    with sim(speedup=20.0) as s:
        client(s.url).completions.create(model="sim-model", prompt="x y z", max_tokens=30)
        text = s.call(lambda: s.server.metrics.render())
    one_row = roofline_step_time("h100-80gb", "llama-3-8b").seconds(StepShape(decode_rows=1, decode_context=20))
    itl = gauge(text, "vllm:inter_token_latency_seconds_sum") / gauge(text, "vllm:inter_token_latency_seconds_count")
    assert itl == pytest.approx(one_row, rel=0.05)   # model seconds: the step, not the event loop's jitter


def test_cohort_probes_the_sim_as_it_probes_vllm(sim, token_table) -> None:
    async def probe(url: str, interval: int):
        up = UpstreamServer(url, stream_interval=interval)
        try:
            await up.discover_model()
            caps = await up.probe(token_table.encode("probe me", add_special_tokens=False), "probe me")
            chunks = [c async for c in up.stream({"prompt": [2000, 2001, 2002], "max_tokens": 9,
                                                  "return_token_ids": True, "stream_interval": interval})]
            return up.model, caps, chunks, await up.metrics()
        finally:
            await up.close()

    with sim(scheduling_policy="priority") as s:
        model, caps, chunks, metrics = asyncio.run(probe(s.url, 4))
    assert model == "sim-model" and caps.token_ids and caps.priority and not caps.refused
    ids = [i for c in chunks for i in (c.ids or [])]
    assert len(ids) == 9 and chunks[-1].completion_tokens == 9
    assert [c.finish for c in chunks if c.finish] == ["length"]
    assert metrics is not None and "vllm:cache_config_info" in metrics
    with sim() as s:                              # FCFS: vLLM refuses a priority, and so does the sim
        _, caps, _, _ = asyncio.run(probe(s.url, 1))
    assert caps.token_ids and not caps.priority


def test_an_api_key_guards_the_v1_routes_as_vllms_does(sim) -> None:
    import httpx

    with sim(api_key="s3cret", ttft_ms=1.0, itl_ms=1.0) as s:
        with pytest.raises(openai.AuthenticationError):
            client(s.url).completions.create(model="sim-model", prompt="a", max_tokens=3)
        keyed = openai.OpenAI(base_url=s.url, api_key="s3cret", max_retries=0, timeout=10)
        assert keyed.completions.create(model="sim-model", prompt="a", max_tokens=3).usage.completion_tokens == 3
        root = s.url.removesuffix("/v1")
        assert httpx.get(f"{root}/health").status_code == 200 and httpx.get(f"{root}/metrics").status_code == 200
        refused = httpx.get(f"{s.url}/models")
        assert refused.status_code == 401 and refused.json() == {"error": "Unauthorized"}
        assert "api_key" not in str(keyed.models.list().data[0].model_extra)  # the key is never echoed


@pytest.mark.slow   # a Python process started: half a second
def test_the_cli_serves_help() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.engine_sim.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=30)
    assert out.returncode == 0 and "--ttft-ms" in out.stdout and "--die-after" in out.stdout
