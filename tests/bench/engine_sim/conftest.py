"""The engine simulator served on a loopback port from a thread of the test process (its own
event loop), so the real ``openai`` SDK can be its client; one tokenizer table for the session."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from bench.engine_sim.cli import make_server
from bench.engine_sim.config import SimConfig
from bench.engine_sim.server import SimServer, start_server
from bench.engine_sim.tokens import FastTokenizer, TokenTable
from cohort.tokenizer import tokenizer_path


@pytest.fixture(scope="session")
def token_table() -> TokenTable:
    return TokenTable(FastTokenizer(tokenizer_path()))


class Served:
    """A running simulator: its base URL (ending in /v1), its state, and its loop."""

    def __init__(self, server: SimServer, url: str, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.url = url
        self.loop = loop

    def call(self, fn: Callable[[], object]) -> object:
        """Run ``fn`` on the server's loop (reading the engine's state safely)."""
        async def run() -> object:
            return fn()
        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(5)

    def run(self, coro, timeout_s: float = 30.0):
        """Run a client coroutine on the server's own loop: a client in another thread would take
        turns with the server for the GIL, every few milliseconds, on every step."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)


@contextmanager
def serving_sim(cfg: SimConfig, tokens: TokenTable, exit_fn=None) -> Iterator[Served]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def up():
        server = make_server(cfg, exit_fn, tokens)
        runner, port = await start_server(server)
        return server, runner, port

    server, runner, port = asyncio.run_coroutine_threadsafe(up(), loop).result(10)
    try:
        yield Served(server, f"http://127.0.0.1:{port}/v1", loop)
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


@pytest.fixture
def sim(token_table):
    """``sim(**options)``: a context manager serving a simulator with those ``SimConfig`` options
    (defaults: a small KV pool, 100x speedup)."""
    def make(exit_fn=None, **kw):
        opts = {"num_gpu_blocks": 400, "max_model_len": 2048, "speedup": 100.0, **kw}
        return serving_sim(SimConfig(**opts), token_table, exit_fn)
    return make
