"""`cohort worker`: one Celery worker process per LLM instance, and `profile`. (`cohort worker
learning` and `beat` are the learning worker's: learning/cli.py; launch puts them under `worker`.)"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import typer

from cohort.bus import queue_for_instance, queue_for_pool
from cohort.heap import freeze_startup_heap
from cohort.settings import get_settings
from predictor.learning import profile_samples_path
from taskq.celery_app import celery_app

app = typer.Typer(help="LLM worker (one per instance) and its tools.", invoke_without_command=True)
log = logging.getLogger(__name__)


def _setup_logging() -> None:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


@app.callback()
def worker(ctx: typer.Context) -> None:
    """Load the model, register the instance, then consume the pool's queue (solo pool: one task at
    a time; under continuous execution a task hands its batch to the engine loop and returns, so
    many batches run at once, all reported by the instance's one publisher thread).

    Solo pool: the model lives in this process and CUDA is never initialised before a fork. (Celery's
    thread pool dies on a broker connection loss — kombu closes a channel whose connection is gone —
    where the solo worker reconnects: measured with `cohort bench chaos`, Redis restarted.)
    """
    if ctx.invoked_subcommand is not None:
        return
    # The model side (torch, transformers) is imported by the commands that load a model, not by
    # every process the `cohort` entry point starts (gateway, batcher, beat, `cohort --help`).
    from workers import runtime

    _setup_logging()
    s = get_settings()
    inbox = None
    if s.upstream:  # an upstream instance: no model here, its server runs the rows
        from workers.upstream_start import start_group_intake, start_upstream

        rt = runtime.set_current(start_upstream(s))
        inbox = start_group_intake(rt)  # an upstream-only pool's groups come on sorted sets, not Celery
    else:
        rt = runtime.start(s)
    freeze_startup_heap()  # the model's and the libraries' objects: never walked by a full collection
    try:
        queues = f"{queue_for_pool(s.pool)},{queue_for_instance(rt.name)}"  # its pool's, and batches routed to it
        # no Celery event heartbeats: nothing reads them (instances heart-beat in ``bus``), and
        # publishing one every 2 s was a twentieth of an upstream worker's CPU at 30 req/s
        celery_app.worker_main(["worker", "--pool=solo", "--concurrency=1", "-Q", queues,
                                "-n", f"{rt.name}@%h", "--loglevel=INFO", "--without-gossip",
                                "--without-mingle", "--without-heartbeat", "--prefetch-multiplier=1"])
    finally:
        if inbox is not None:
            inbox.set()
        if rt.publisher is not None:  # a warm shutdown lets the running rows finish and be answered
            rt.publisher.drain(s.request_timeout_s)
        rt.deregister()


@app.command()
def profile(out: Path = typer.Option(None, help="Where to store samples (default: data_dir)."),
            sizes: str = "1,4,16", input_lens: str = "16,128,512", gen_lens: str = "16,64,256") -> None:
    """Run a grid of batch shapes on the configured model and store (β, L, G, seconds) samples."""
    from workers.engine import LLMEngine  # torch + transformers: see worker()
    from workers.profile import run_profile

    _setup_logging()
    s = get_settings()
    grid = [(b, L, G) for b in map(int, sizes.split(",")) for L in map(int, input_lens.split(","))
            for G in map(int, gen_lens.split(","))]
    out = out or profile_samples_path(s)
    engine = LLMEngine(s)
    too_big = [shape for shape in grid if not engine.fits(*shape)]
    if too_big:
        typer.echo(f"skipping {len(too_big)} shapes that exceed the instance's KV memory: {too_big}", err=True)
    samples = run_profile(engine, [shape for shape in grid if engine.fits(*shape)], out)
    typer.echo(json.dumps({"samples": len(samples), "out": str(out)}))


@app.command("export-model")
def export_model(out: Path = typer.Argument(..., help="Folder to write (config, weights, tokenizer).")) -> None:
    """Save the configured model and its tokenizer as an HF model folder, so another engine
    (vLLM, `transformers serve`) can serve the very model cohort's own worker runs — the built-in
    random-weight Llama included — for upstream tests and side-by-side benchmarks."""
    from workers.model import load_model  # torch + transformers: see worker()

    _setup_logging()
    model, tok, _device = load_model(get_settings())
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    typer.echo(json.dumps({"model": str(out)}))
