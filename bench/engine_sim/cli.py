"""`cohort engine-sim ...`: the simulated vLLM engine (``serve``), the measurement of its own
CPU cost in fixed-delay mode (``cpu-cost``), the fit of its step time to a running engine
(``fit``) and the comparison of a fitted simulator with that engine (``fidelity``).
docs/engine_sim.md is the user's page."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from bench.engine_sim.config import SimConfig, build_engine
from cohort.event_loops import new_event_loop

app = typer.Typer(help="A simulated vLLM engine (OpenAI API): benchmark and test equipment.", no_args_is_help=True)
log = logging.getLogger("bench.engine_sim")


def load_tokens(path: str | None, seed: int = 0):
    """The token table of a tokenizer folder (default: cohort's built-in model's): the fast
    backend when it fits, else HF's (``tokens`` module docstring)."""
    from bench.engine_sim.tokens import FastTokenizer, TokenTable
    from cohort.tokenizer import tokenizer_path

    path = path or tokenizer_path()
    if FastTokenizer.fits(path):
        return TokenTable(FastTokenizer(path), seed=seed, path=path)
    from bench.engine_sim.hf_tokens import HFTokenizer

    return TokenTable(HFTokenizer(path), seed=seed, path=path)


def make_engine(cfg: SimConfig, exit_fn=None):
    """The engine the options describe; the stepped one timed by ``--fit`` or the roofline, its KV
    pool ``--num-gpu-blocks`` or the roofline's (loaded only for these: ``roofline_steps``)."""
    if cfg.fixed_delay:
        return build_engine(cfg, exit_fn=exit_fn)
    from bench.engine_sim.step_time import load_fit

    step_time = load_fit(cfg.fit) if cfg.fit else None
    blocks = cfg.num_gpu_blocks
    if step_time is None or blocks is None:
        from bench.engine_sim.roofline_steps import default_num_blocks, roofline_step_time

        step_time = step_time or roofline_step_time(cfg.gpu, cfg.model, cfg.tp)
        blocks = blocks or default_num_blocks(cfg.gpu, cfg.model, cfg.tp, cfg.block_size)
    return build_engine(cfg, step_time, blocks, exit_fn)


def make_server(cfg: SimConfig, exit_fn=None, tokens=None):
    """The engine, token table and app state the options describe."""
    from bench.engine_sim.server import SimServer

    return SimServer(cfg, make_engine(cfg, exit_fn), tokens or load_tokens(cfg.tokenizer, cfg.seed))


@app.command("serve")
def serve_sim(
    port: int = typer.Option(8000, help="The port to listen on."),
    host: str = typer.Option("127.0.0.1", help="The address to listen on."),
    model_name: str = typer.Option("sim-model", help="The model id /v1/models lists and requests name."),
    tokenizer: str = typer.Option(None, help="A tokenizer folder (HF); default: cohort's built-in model's."),
    gpu: str = typer.Option("h100-80gb", help="Roofline GPU preset (bench/roofline.py GPUS)."),
    model: str = typer.Option("llama-3-8b", help="Roofline model preset (bench/roofline.py MODELS)."),
    tp: int = typer.Option(1, help="Tensor-parallel GPUs (memory, FLOP/s and bandwidth times tp)."),
    fit: Path = typer.Option(None, help="Fitted step-time coefficients (JSON) instead of the roofline."),
    num_gpu_blocks: int = typer.Option(None, help="KV blocks; default: the roofline's KV memory in blocks."),
    block_size: int = typer.Option(16, help="Tokens per KV block."),
    max_num_seqs: int = typer.Option(256, help="Most requests running at once."),
    max_num_batched_tokens: int = typer.Option(8192, help="Token budget of one step (chunked prefill)."),
    max_model_len: int = typer.Option(8192, help="Prompt + output tokens of one request, at most."),
    scheduling_policy: str = typer.Option("fcfs", help="fcfs, or priority (lower value first, then arrival)."),
    no_prefix_caching: bool = typer.Option(False, help="Turn prefix caching off."),
    speedup: float = typer.Option(1.0, help="Model time runs this many times faster than wall time."),
    ttft_ms: float = typer.Option(None, help="Fixed-delay engine: first token after this many ms."),
    itl_ms: float = typer.Option(None, help="Fixed-delay engine: one token every this many ms after it."),
    max_waiting: int = typer.Option(0, help="Answer 429 when this many wait (fixed-delay: in flight); 0: no bound."),
    die_after: int = typer.Option(0, help="Exit hard (os._exit) mid-stream in the Nth admitted request."),
    stall_after: int = typer.Option(0, help="Stop emitting tokens for --stall-s wall seconds at the Nth request."),
    stall_s: float = typer.Option(0.0, help="How long the stall lasts (wall seconds)."),
    error_rate: float = typer.Option(0.0, help="This fraction of requests answer 500 (seeded)."),
    seed: int = typer.Option(0, help="Seeds the output tokens, the output vocabulary and the error draw."),
    api_key: str = typer.Option(None, envvar="VLLM_API_KEY",
                                help="As vLLM's: /v1 routes answer 401 without `Authorization: Bearer KEY`."),
    log_level: str = typer.Option("INFO"),
) -> None:
    """Serve vLLM's OpenAI API from a simulated engine: a vLLM-v1-shaped step loop timed by the
    roofline or a fit, or (--ttft-ms/--itl-ms) a zero-compute fixed-delay engine."""
    from aiohttp import web

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")
    cfg = SimConfig(model_name=model_name, tokenizer=tokenizer, gpu=gpu, model=model, tp=tp,
                    fit=str(fit) if fit else None, num_gpu_blocks=num_gpu_blocks, block_size=block_size,
                    max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                    max_model_len=max_model_len, scheduling_policy=scheduling_policy,
                    enable_prefix_caching=not no_prefix_caching, speedup=speedup, ttft_ms=ttft_ms, itl_ms=itl_ms,
                    max_waiting=max_waiting, die_after=die_after, stall_after=stall_after, stall_s=stall_s,
                    error_rate=error_rate, seed=seed, api_key=api_key or None)
    try:
        server = make_server(cfg)
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None
    info = server.engine.describe()
    log.info("engine-sim: %s serving %s on http://%s:%d/v1, speedup %gx (model time = wall time x %g), %s",
             info["mode"], model_name, host, port, speedup, speedup, json.dumps(info))
    if info["mode"] == "engine":
        log.info("engine-sim: %d KV blocks of %d tokens, max_num_seqs %d, %d tokens per step, max_model_len %d, %s",
                 server.metrics.num_gpu_blocks, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                 scheduling_policy)
    loop = None
    if info["mode"] == "fixed-delay":
        # a fifth less of its core's CPU a request on uvloop (a front's benchmark shares that core with
        # the client). Its timers fire to the millisecond, up to half a millisecond early, so the
        # stepped engine, whose steps are laid on exact deadlines, keeps asyncio's own loop.
        loop = new_event_loop()
    web.run_app(server.app(), host=host, port=port, handler_cancellation=True, access_log=None, print=None, loop=loop)


@app.command("cpu-cost")
def cpu_cost(
    requests: int = typer.Option(600, help="Streaming requests to send."),
    tokens: int = typer.Option(40, help="Tokens each request streams."),
    concurrency: int = typer.Option(50, help="Requests in flight at once."),
    ttft_ms: float = typer.Option(20.0), itl_ms: float = typer.Option(5.0),
    out: Path = typer.Option(None, help="Write the result as JSON here too."),
) -> None:
    """Measure the fixed-delay engine's own CPU per streamed request: it is started as a separate
    process and its CPU time (psutil) read around a run of the given streaming requests."""
    from bench.engine_sim.cpu_cost import measure

    res = measure(requests=requests, tokens=tokens, concurrency=concurrency, ttft_ms=ttft_ms, itl_ms=itl_ms)
    text = json.dumps(res, indent=2)
    typer.echo(text)
    if out:
        out.write_text(text + "\n")


@app.command("fit")
def fit_cmd(
    upstream: str = typer.Option(..., "--upstream", help="The engine's base URL (vLLM, or a simulator), loopback."),
    out: Path = typer.Option(..., help="Write the fitted coefficients here (JSON; serve --fit reads it)."),
    duration: float = typer.Option(150.0, help="Seconds of replay in all (split among the concurrencies)."),
    concurrency: str = typer.Option("1,2,4,8,16,32", help="Closed-loop clients, one level after another."),
    max_prompt: int = typer.Option(1024, help="Longest prompt (tokens); keep it under the engine's token budget."),
    max_output: int = typer.Option(128, help="Largest max_tokens of a request."),
    seed: int = typer.Option(0),
    relative: bool = typer.Option(False, help="Least squares of relative residuals (default: plain, unbiased)."),
    traces: Path = typer.Option(None, help="Also write each request's token arrival times here (JSON)."),
    text_prompts: bool = typer.Option(False, help="Prompts of random words (tokenized by the server) instead of ids."),
    warmup: float = typer.Option(10.0, help="Seconds of replay at the highest concurrency first, not fitted (a fresh "
                                 "engine's first seconds can be slow)."),
) -> None:
    """Fit the step-time coefficients (--fit FILE) to the engine at --upstream: a replay of
    streamed completions at several concurrencies, its steps rebuilt from when each token arrived
    (bench/engine_sim/fit_upstream.py), both linear forms fitted; the file holds linear-v2's fitted
    with the front end's per-request cost (bench/engine_sim/fit_front.py)."""
    from bench.engine_sim.fit_upstream import fit_upstream

    levels = tuple(int(x) for x in concurrency.split(",") if x.strip())
    res = fit_upstream(upstream, duration, levels, max_prompt, max_output, seed, relative, traces, text_prompts,
                       warmup)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    e = res["fit_error"]["all"]
    typer.echo(f"{res['samples']} step samples from {res['steps']['gaps']} token gaps, "
               f"{res['replay']['done']} requests; linear-v2 with front end: median error {100 * e['median']:.1f} %, "
               f"p90 {100 * e['p90']:.1f} %; front end f = {1e3 * res.get('f', 0.0):.2f} ms + "
               f"g = {1e6 * res.get('g', 0.0):.2f} us a prompt token; written to {out}")


if __name__ == "__main__":   # `python -m bench.engine_sim.cli serve …`: without the rest of `cohort`'s imports
    app()
