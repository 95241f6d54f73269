"""`cohort bench upstream` end to end against two engines on loopback HTTP servers (no cohort
stack): ``direct`` and ``direct-fcfs`` replay the same workload, each against its own engine with
its own model id, and the ratios are to the first of them."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from contextlib import AsyncExitStack

import pytest
from aiohttp import web
from typer.testing import CliRunner

from bench.cli import app
from tests.loopback import answer, serving


def _engine(model: str, seen: list[str]) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append(body["model"])
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for i in range(int(body["max_tokens"])):
            chunk = {"choices": [{"index": 0, "text": f" t{i}", "finish_reason": None}]}
            await r.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await r.write(b"data: [DONE]\n\n")
        return r

    app_ = web.Application()
    app_.router.add_post("/v1/completions", completions)
    app_.router.add_get("/v1/models", answer(lambda: web.json_response({"data": [{"id": model}]})))
    return app_


@pytest.fixture
def engines() -> Iterator[tuple[list[str], dict[str, list[str]]]]:
    """Two engines on their own event loop thread: their base URLs and the model ids each was sent."""
    loop = asyncio.new_event_loop()
    seen: dict[str, list[str]] = {"prio": [], "fcfs": []}
    servers = AsyncExitStack()

    async def start() -> list[str]:
        return [await servers.enter_async_context(serving(_engine(f"{name}-model", seen[name])))
                for name in ("prio", "fcfs")]

    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield asyncio.run_coroutine_threadsafe(start(), loop).result(10), seen
    asyncio.run_coroutine_threadsafe(servers.aclose(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.mark.slow  # seconds of real work: `make test` runs it, the fast loop does not
def test_direct_and_direct_fcfs_replay_one_workload_on_their_own_engines(engines, tiny_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the row cache goes to ./var/bench/cache
    (prio, fcfs), seen = engines
    out = tmp_path / "r.json"
    args = ["upstream", "--upstream", prio, "--fcfs-upstream", fcfs, "--targets", "direct-fcfs,direct,direct-fcfs",
            "--loads", "1.0", "--capacity", "200", "--requests", "6", "--max-tokens", "4", "--json", str(out)]
    for f in tiny_files:
        args += ["--data", f]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    assert d["config"]["fcfs_engine"] == fcfs and d["ratios_to"] == "direct-fcfs"
    assert set(d["by_load"]["1"]) == {"direct-fcfs", "direct", "direct-fcfs#2"}
    assert all(m["done"] == 6 for m in d["by_load"]["1"].values())
    assert seen == {"prio": ["prio-model"] * 6, "fcfs": ["fcfs-model"] * 12}


@pytest.mark.slow
def test_direct_fcfs_without_its_engine_is_a_clear_error(engines, tiny_files, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (prio, _fcfs), seen = engines
    args = ["upstream", "--upstream", prio, "--targets", "direct,direct-fcfs", "--capacity", "0",
            "--requests", "6", "--data", tiny_files[0]]
    r = CliRunner().invoke(app, args)
    assert r.exit_code != 0 and "--fcfs-upstream" in r.output
    assert seen == {"prio": [], "fcfs": []}  # refused before anything ran, the capacity burst too
