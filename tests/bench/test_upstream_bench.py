"""The upstream benchmark's client and arithmetic: how it times a stream, and the per-request record
that paired comparisons read."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from aiohttp import web

import bench.live_stack as live_stack
from bench.upstream_bench import StreamResult, per_request, replay_streams, summarize
from bench.workload import RowTable, Workload, WorkloadConfig
from cohort.datasets import Record
from tests.loopback import serving


def _result(sent, first, done) -> StreamResult:
    n = len(sent)
    return StreamResult(np.array(sent, float), np.array(first, float), np.array(done, float),
                        np.full(n, 10), np.zeros(n), ~np.isnan(np.array(done, float)), max(done), {})


def test_the_per_request_record_has_none_where_a_request_got_no_answer():
    res = _result([0.0, 0.0], [0.1, math.nan], [1.0, math.nan])
    rows = per_request(res)
    assert rows["first"] == [0.1, None] and rows["done"] == [1.0, None] and rows["tokens"] == [10, 10]


def _workload(n: int, rate: float = 200.0):
    rows = RowTable(records=[Record("t", "Say", f"row {i}", "") for i in range(n)], file_index=np.zeros(n, int),
                    input_tokens=np.full(n, 3), output_tokens=np.full(n, 4))
    return Workload(config=WorkloadConfig(files=[], requests=n, max_tokens=16), rows=rows, row=np.arange(n),
                    arrival=np.arange(n) / rate, input_tokens=np.full(n, 3), true_tokens=np.full(n, 4),
                    predicted_tokens=np.full(n, 4), slo_s=np.full(n, 5.0))


@pytest.mark.slow  # 0.66 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_the_client_times_streams_from_a_real_server_and_counts_empty_text_chunks_as_tokens():
    """A real HTTP server on loopback: four tokens of which the first two decode to "" (as a random
    model's special tokens do), 0.3 s apart, then usage; a prompt naming row 2 gets a 503."""
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if body["prompt"].endswith("row 2"):
            return web.json_response({"error": {"message": "busy"}}, status=503)
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        for text, finish, gap in (("", None, 0.0), ("", None, 0.3), ("a", None, 0.3), ("b", "length", 0.0)):
            await asyncio.sleep(gap)
            chunk = {"choices": [{"index": 0, "text": text, "finish_reason": finish}]}
            await r.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await r.write(b'data: {"choices": [], "usage": {"completion_tokens": 4}}\n\ndata: [DONE]\n\n')
        return r

    async def run():
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        async with serving(app) as url:
            wl = _workload(4)
            return wl, await replay_streams(wl, url, lambda i, p: {"prompt": p})

    wl, res = asyncio.run(run())
    assert list(res.ok) == [True, True, False, True] and res.errors == {"http_503": 1}
    assert list(res.tokens) == [4, 4, 0, 4]
    # the first token is the first (empty) chunk, 0.6 s before the end, not the first with text
    assert ((res.done - res.first)[res.ok] > 0.5).all()
    assert (res.itl_sum[res.ok] > 0.5).all()
    m = summarize(wl, res)
    assert m["done"] == 3 and m["lost"] == 1 and 0.5 / 3 < m["mean_itl_s"] < 1.0 / 3


def test_a_spawned_stack_starts_from_an_empty_folder(tmp_path, monkeypatch):
    """What an earlier run left (its log DB, Redis data, the predictor's online state) is gone before
    the next stack starts: a benchmark result must not depend on what ran in that folder before."""
    seen: dict[str, bool] = {}

    class FakeRedis:
        url = "redis://:pw@127.0.0.1:1/0"

        def __init__(self, folder):
            seen["state_left"] = (tmp_path / "spf" / "var" / "online_state.json").exists()

        def close(self):
            pass

    class FakeStack:
        def __init__(self, env, url, log_dir):
            self.url = url

        def start_core(self, host, port):
            pass

        def wait_healthy(self, timeout_s):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(live_stack, "EmbeddedRedis", FakeRedis)
    monkeypatch.setattr(live_stack, "Stack", FakeStack)
    (tmp_path / "spf" / "var").mkdir(parents=True)
    (tmp_path / "spf" / "var" / "online_state.json").write_text("{}")
    with live_stack.spawned_stack("spf", {}, tmp_path):
        pass
    assert seen == {"state_left": False}


_HOLDS_A_STACK = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import bench.live_stack as live_stack

    class FakeRedis:
        url = "redis://:pw@127.0.0.1:1/0"
        def __init__(self, folder): pass
        def close(self): Path(sys.argv[1], "redis-closed").touch()

    class FakeStack:
        def __init__(self, env, url, log_dir): self.url = url
        def start_core(self, host, port): pass
        def wait_healthy(self, timeout_s): pass
        def stop(self): Path(sys.argv[1], "stack-stopped").touch()

    live_stack.EmbeddedRedis, live_stack.Stack = FakeRedis, FakeStack
    with live_stack.spawned_stack("spf", {}, Path(sys.argv[1])):
        print("ready", flush=True)
        time.sleep(60)
""")


@pytest.mark.slow  # 2.06 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_a_benchmark_killed_with_sigterm_stops_the_stack_it_spawned(tmp_path):
    """SIGTERM (``kill``, a CI timeout) goes through the stack's cleanup as Ctrl-C does: before, the
    benchmark died and its gateway, batcher and Redis ran on, on the core the next run measured."""
    proc = subprocess.Popen([sys.executable, "-c", _HOLDS_A_STACK, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert (tmp_path / "stack-stopped").exists() and (tmp_path / "redis-closed").exists()
