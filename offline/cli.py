"""`cohort batch …`: the job runner process, and a batch file run from the command line.

``cohort batch runner`` is the process that carries Batch API jobs (offline.runner); ``cohort
serve`` starts it. ``cohort batch run INPUT.jsonl -o OUTPUT.jsonl`` runs a batch file (OpenAI's
format, which vLLM's ``run-batch`` also reads) against a running gateway (``--url``), or against
an embedded stack it starts and stops (``--embedded``), and writes one OpenAI output line per
input line — answers and errors alike, as ``run-batch`` does — with a progress bar.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import tempfile
from pathlib import Path

import httpx
import typer
from tqdm import tqdm

from cohort import jobdb
from cohort.settings import get_settings
from offline.lines import DONE, RETRY, outcome, parse_input, response_line
from offline.runner import BACKOFF_S, JobRunner

app = typer.Typer(help="Offline jobs: the Batch API's job runner and batch files from the command line.",
                  no_args_is_help=True)
log = logging.getLogger("cohort.offline")
ENDPOINTS = jobdb.BATCH_ENDPOINTS


@app.command()
def runner() -> None:
    """Run the job runner: validates Batch API jobs, sends their rows through the gateway at a
    background priority, writes their output and error files. Stop with SIGTERM/Ctrl-C."""
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await JobRunner(get_settings()).run(stop)

    asyncio.run(main())


async def run_file(url: str, rows: list[dict], api_key: str | None, concurrency: int, attempts: int,
                   priority: int) -> dict[int, str]:
    """Send every row (bounded concurrency, transient failures sent again) and return its line by index."""
    out: dict[int, str] = {}
    errors = 0
    sem = asyncio.Semaphore(concurrency)
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    bar = tqdm(total=len(rows), desc="batch", unit="req")
    async with httpx.AsyncClient(base_url=url, timeout=None, headers=headers) as client:
        async def one(r: dict) -> None:
            nonlocal errors
            async with sem:
                for attempt in range(1, attempts + 1):
                    try:
                        resp = await client.post(r["url"], json={**r["body"], "priority": priority})
                        (kind, body), status, rid = outcome(resp), resp.status_code, resp.headers.get("x-request-id")
                    except httpx.HTTPError as e:
                        kind, status, rid = RETRY, 503, None
                        body = {"error": {"message": f"the gateway did not answer: {e}", "type": "server_error",
                                          "param": None, "code": "gateway_unavailable"}}
                    if kind != RETRY or attempt == attempts:
                        break
                    await asyncio.sleep(BACKOFF_S * attempt)
                out[r["idx"]] = response_line("batch-cli", r["idx"], r["custom_id"], status, rid, body)
                bar.update(1)
                if kind != DONE:
                    errors += 1
                    bar.set_postfix(errors=errors)

        await asyncio.gather(*(one(r) for r in rows))
    bar.close()
    return out


@app.command()
def run(input_file: Path = typer.Argument(..., exists=True, dir_okay=False, help="OpenAI batch file (JSONL)"),
        output: Path = typer.Option(..., "-o", "--output", help="Where the output lines go (JSONL)"),
        url: str | None = typer.Option(None, help="A running gateway; unset: http://COHORT_HOST:COHORT_PORT"),
        api_key: str | None = typer.Option(None, envvar="OPENAI_API_KEY", help="Key for /v1, when keys are on"),
        embedded: bool = typer.Option(False, help="Start an embedded stack for this run and stop it after"),
        concurrency: int = typer.Option(64, min=1, help="Requests in flight at once")) -> None:
    """Run a batch file and write its output lines, in input order (errors included)."""
    s = get_settings()
    parsed = parse_input(input_file.read_text(encoding="utf-8"), "batch-cli", ENDPOINTS, s.batch_max_rows)
    if parsed.fatal:
        raise typer.BadParameter(parsed.fatal, param_hint="INPUT_FILE")
    stack = _embedded_stack() if embedded else None
    try:
        base = stack.url if stack else (url or s.offline.gateway_url or f"http://{s.host}:{s.port}")
        lines = asyncio.run(run_file(base, parsed.rows, api_key, concurrency, s.offline.max_attempts,
                                     s.offline.priority))
    finally:
        if stack:
            stack.stop()
    lines.update({e["idx"]: e["line"] for e in parsed.errors})
    output.write_text("".join(lines[i] + "\n" for i in sorted(lines)), encoding="utf-8")
    failed = sum(1 for v in lines.values() if json.loads(v)["error"] or json.loads(v)["response"]["status_code"] != 200)
    typer.echo(f"{len(lines)} requests: {len(lines) - failed} answered, {failed} errors -> {output}")


def _embedded_stack():
    """Worker, batcher and gateway on a free port with an embedded Redis (what `cohort serve` runs)."""
    from procstack.embedded_redis import EmbeddedRedis
    from procstack.stack import Stack, free_port

    s = get_settings()
    redis = EmbeddedRedis(s.data_dir / "redis") if not s.redis_url else None
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    if redis:
        env["COHORT_REDIS_URL"] = redis.url
    port = free_port()
    stack = Stack(env, f"http://127.0.0.1:{port}", log_dir=Path(tempfile.mkdtemp(prefix="cohort-batch-")))
    stop = stack.stop

    def stop_all(grace_s: float = 20.0) -> None:
        stop(grace_s)
        if redis:
            redis.close()

    stack.stop = stop_all  # type: ignore[method-assign]
    typer.echo(f"starting an embedded stack (logs in {stack.log_dir}) …")
    stack.start_core("127.0.0.1", port)
    stack.wait_healthy()
    return stack
