"""``cohort engine-sim fit`` against the simulator itself: a replay on a roofline-timed simulator,
its steps rebuilt from the client's chunk times, the fit checked against the roofline's own step
times, and the file it writes read back by ``--fit``."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from bench.engine_sim.config import SimConfig
from bench.engine_sim.fit import fit_errors
from bench.engine_sim.fit_upstream import (
    FRONT_FIT,
    Trace,
    _one,
    fit_replay,
    fit_upstream,
    metric_labels,
    metric_value,
    robust_fit,
    step_runs,
)
from bench.engine_sim.roofline_steps import roofline_step_time
from bench.engine_sim.step_time import FIT_FORM, FIT_FORM_V2, FittedStepTime, StepShape, load_fit
from tests.bench.engine_sim.conftest import serving_sim

SPEEDUP = 2.0


@pytest.fixture(scope="module")
def fitted_run(token_table):
    cfg = SimConfig(num_gpu_blocks=4000, max_model_len=2048, speedup=SPEEDUP)
    with serving_sim(cfg, token_table) as s:
        run = s.run(fit_replay(s.url, duration_s=6.0, concurrency=(1, 4, 16), max_prompt=1024, max_output=64,
                           vocab=(1000, 5000)), timeout_s=60)
    speedup = metric_value(run.metrics_after, "engine_sim_speedup")
    return run, speedup


@pytest.mark.slow  # 6.23 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_the_steps_rebuilt_from_chunk_times_fit_the_roofline(fitted_run) -> None:
    run, speedup = fitted_run
    assert speedup == SPEEDUP
    assert metric_labels(run.metrics_after, "vllm:cache_config_info")["num_gpu_blocks"] == "4000"
    runs, why = step_runs(run.traces, speedup)
    assert len(runs) > 100 and why["multi_token_requests"] == 0
    roof = roofline_step_time("h100-80gb", "llama-3-8b")
    # the rebuilt steps: what the roofline says of their shapes is the time the client measured
    truth = np.array([abs(sum(map(roof.seconds, s)) - t) / t for s, t in runs])
    jitter = float(np.median(truth))
    assert jitter < 0.05   # a shared core's jitter on ~5 ms steps: 1.0-1.1 % idle, 2.3 % beside three busy loops
    fit, _ = robust_fit(runs, FIT_FORM_V2)
    err = fit_errors(fit, runs)
    # the fit is as good as the roofline's own times, less the linear form's bias on steps that are
    # a max of compute and memory: 2.6-2.8 points idle (three runs) and 1.9 beside three busy loops;
    # a loaded CI run measured 5.4 % in all, which a fixed 5 % bound failed
    assert err["all"]["median"] < jitter + 0.04 and err["with_prefill"]["samples"] > 10
    # and one step at a time, on shapes of the kind the replay made. The linear form is biased at
    # these shapes (the roofline is a max of compute and memory): −6.6 to −6.9 % on an idle machine
    # (three runs), −8.0 % once in a loaded CI run; 10 % holds the bias and that jitter
    for shape in (StepShape(decode_rows=8, decode_context=8 * 600),
                  StepShape(decode_rows=16, decode_context=16 * 300)):
        assert fit.seconds(shape) == pytest.approx(roof.seconds(shape), rel=0.10)


def test_the_fit_file_is_read_by_load_fit(tmp_path) -> None:
    v2 = FittedStepTime(0.004, 2e-5, 1e-4, 3e-8, a_p=0.002, e=5e-4)
    f = tmp_path / "fit.json"
    f.write_text(json.dumps({**v2.to_json(), "samples": 10, "fits": {}}))
    assert load_fit(f) == v2
    assert v2.seconds(StepShape(prefill_tokens=100, prefill_rows=2, decode_rows=3, decode_context=30)) == \
        pytest.approx(0.004 + 0.002 + 2e-5 * 100 + 5e-4 * 2 + 1e-4 * 3 + 3e-8 * 30)
    v1 = FittedStepTime(0.004, 2e-5, 1e-4, 3e-8)
    assert v1.to_json()["form"] == FIT_FORM and "a_p" not in v1.to_json()


@pytest.mark.slow  # 1.72 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_the_fit_command_writes_a_file_serve_reads(token_table, tmp_path) -> None:
    """``fit_upstream`` end to end (the client in this thread, the simulator in its own): the JSON
    it writes carries the engine's cache config and both forms, and ``--fit`` loads it."""
    cfg = SimConfig(num_gpu_blocks=500, block_size=128, max_model_len=2048, speedup=SPEEDUP)
    with serving_sim(cfg, token_table) as s:
        res = fit_upstream(s.url, duration_s=1.5, concurrency=(2, 6), max_prompt=512, max_output=32)
    f = tmp_path / "fit.json"
    f.write_text(json.dumps(res))
    assert res["engine"]["cache_config_info"]["block_size"] == "128" and res["engine"]["speedup"] == SPEEDUP
    assert set(res["fits"]) == {FIT_FORM, FIT_FORM_V2, FRONT_FIT} and res["samples"] > 20
    assert load_fit(f) == FittedStepTime.of(FIT_FORM_V2, [res.get(k, 0.0) for k in ("a", "b", "c", "d", "a_p", "e", "f", "g")])
    # No bound on the front end fitted here: the simulator has none, so what the fit finds is this
    # machine's CPU time per request (its tokenizer, the event loop's turns), and beside three busy
    # loops that was 0-0.8 of a step's floor at 512 tokens. That the fit recovers a known front end
    # is tested on made samples (test_front_end.py).


def test_runs_of_steps_recover_linear_v2() -> None:
    """Runs of 8 steps, timed as wholes, give back the coefficients that made them, even with
    most runs holding a prefill step (a per-step and a per-prefill-step constant nearly collinear)."""
    truth = FittedStepTime(0.006, 2e-5, 4e-4, 1e-8, a_p=0.003, e=1e-3)
    rng = np.random.default_rng(0)
    runs = []
    for _ in range(300):
        shapes = []
        for _ in range(8):
            pre = int(rng.integers(50, 900)) if rng.random() < 0.3 else 0
            rows = int(rng.integers(1, 32))
            shapes.append(StepShape(prefill_tokens=pre, prefill_context=pre,
                                    prefill_rows=int(rng.integers(1, 4)) if pre else 0,
                                    decode_rows=rows, decode_context=rows * int(rng.integers(20, 1500))))
        runs.append((tuple(shapes), sum(map(truth.seconds, shapes))))
    fit, kept = robust_fit(runs, FIT_FORM_V2)
    assert len(kept) == len(runs)
    for got, want in zip((fit.a, fit.b, fit.c, fit.d, fit.a_p, fit.e),
                         (truth.a, truth.b, truth.c, truth.d, truth.a_p, truth.e), strict=True):
        assert got == pytest.approx(want, rel=1e-4)


@pytest.mark.slow  # 0.53 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_text_prompts_take_the_engines_token_count(token_table) -> None:
    cfg = SimConfig(num_gpu_blocks=500, max_model_len=2048, speedup=SPEEDUP)
    with serving_sim(cfg, token_table) as s:
        run = s.run(fit_replay(s.url, duration_s=0.5, concurrency=(2,), max_prompt=200, max_output=8,
                               text_prompts=True), timeout_s=30)
    done = [t for t in run.traces if t.ok]
    assert done and len(done) == len(run.traces)
    # each prompt's length is the server's count of its tokens (the words, [CLS] and [SEP])
    assert sum(t.prompt_tokens for t in done) == metric_value(run.metrics_after, "vllm:prompt_tokens_total")


@pytest.mark.slow  # 0.85 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_warm_up_runs_first_and_is_not_recorded(token_table) -> None:
    cfg = SimConfig(num_gpu_blocks=500, max_model_len=2048, speedup=SPEEDUP)
    with serving_sim(cfg, token_table) as s:
        run = s.run(fit_replay(s.url, duration_s=0.5, concurrency=(2,), max_prompt=200, max_output=8,
                               text_prompts=True, warmup_s=0.3), timeout_s=30)
    done = [t for t in run.traces if t.ok]
    assert done and len(done) == len(run.traces)
    served = metric_value(run.metrics_after, "vllm:prompt_tokens_total")
    recorded = sum(t.prompt_tokens for t in done)
    # the counters are read after the warm-up: the recorded replay is what they grew by since
    assert recorded == served - metric_value(run.metrics_before, "vllm:prompt_tokens_total") and recorded < served
    assert min(min(t.times) for t in done) >= 0  # times from the recorded replay's start


def test_a_dropped_connection_leaves_its_request_out_and_the_replay_goes_on() -> None:
    """A server closing a connection mid-stream (as one closes a kept-alive connection the client
    reuses) fails that request alone; the next one is recorded."""
    served = 0

    async def completions(request: web.Request) -> web.StreamResponse:
        nonlocal served
        served += 1
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"token_ids": [7]}]}\n\n')
        if served == 1:
            request.transport.close()  # the connection drops before the end
            return resp
        await resp.write(b'data: {"choices": [{"token_ids": [8]}], "usage": {"prompt_tokens": 3}}\n\ndata: [DONE]\n\n')
        return resp

    async def main() -> list[Trace]:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]
        traces = [Trace(3, 0.0), Trace(3, 0.0)]
        try:
            async with aiohttp.ClientSession() as session:
                for tr in traces:
                    await _one(session, f"http://127.0.0.1:{port}/v1/completions", {}, tr, 0.0)
        finally:
            await runner.cleanup()
        return traces

    dropped, kept = asyncio.run(main())
    assert not dropped.ok
    assert kept.ok and len(kept.times) == 2
