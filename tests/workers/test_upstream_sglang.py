"""What cohort reads from an SGLang server, on a loopback HTTP server that answers as SGLang does:
its settings at ``/get_server_info`` (``/server_info`` absent, as before the rename), its gauges at
``/metrics``, and a ``priority`` it takes without complaint whether it uses it or not. SGLang itself
is not run here (its PyPI wheels want CUDA); the vLLM and ``transformers serve`` paths run for real in
tests/e2e."""

from __future__ import annotations

import asyncio
import json
import time

from aiohttp import web

from cohort.types import ProfiledRequest
from tests.loopback import answer, serving
from upstream.api import (
    Capabilities,
    UpstreamServer,
    kv_tokens_from_metrics,
    queue_from_metrics,
    read_server_settings,
)

SGLANG_METRICS = """# HELP sglang:max_total_num_tokens Maximum total number of tokens in the KV cache pool.
# TYPE sglang:max_total_num_tokens gauge
sglang:max_total_num_tokens{model_name="sg"} 5000.0
sglang:num_queue_reqs{model_name="sg"} 2.0
sglang:num_running_reqs{model_name="sg"} 9.0
"""


def _settings(priority_scheduling: bool, low_values_first: bool) -> dict:
    return {"enable_priority_scheduling": priority_scheduling, "schedule_low_priority_values_first": low_values_first,
            "max_total_num_tokens": 5000, "page_size": 1, "version": "0.5"}


async def _probe(settings: dict) -> tuple[UpstreamServer, list[dict], str | None]:
    bodies: list[dict] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        bodies.append(await request.json())
        r = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await r.prepare(request)
        chunk = {"choices": [{"index": 0, "text": "a", "finish_reason": "length"}]}
        await r.write(f"data: {json.dumps(chunk)}\n\ndata: [DONE]\n\n".encode())
        return r

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", answer(lambda: web.json_response({"data": [{"id": "sg"}]})))
    app.router.add_get("/get_server_info", answer(lambda: web.json_response(settings)))
    app.router.add_get("/metrics", answer(lambda: web.Response(text=SGLANG_METRICS)))
    async with serving(app) as url:
        server = UpstreamServer(url)
        try:
            await server.discover_model()
            await server.probe([1, 2, 3], "Hello")
            return server, bodies, await server.metrics()
        finally:
            await server.close()


def _req() -> ProfiledRequest:
    return ProfiledRequest(id="r", prompt="hi", input_tokens=2, predicted_tokens=4, max_tokens=4, arrival=time.time())


def test_an_sglang_server_running_larger_priorities_first_gets_cohorts_order_negated():
    """SGLang's default with --enable-priority-scheduling runs larger values first; cohort's priority
    is vLLM's (smaller first), so it goes negated: the urgent row stays the urgent one there."""
    server, bodies, metrics = asyncio.run(_probe(_settings(True, False)))
    assert bodies and bodies[0]["model"] == "sg"
    caps = server.caps
    assert caps.priority and caps.priority_sign == -1 and "negated" in caps.describe()
    assert caps.kv_tokens == 5000 and caps.page_tokens == 1
    assert server.body(_req(), [1, 2], 4, 7)["priority"] == -7
    assert kv_tokens_from_metrics(metrics) == 5000 and queue_from_metrics(metrics) == 2.0


def test_an_sglang_server_without_priority_scheduling_is_sent_none():
    """It accepts a priority it then ignores, so only its settings tell; and with
    --schedule-low-priority-values-first its order is cohort's."""
    server, _bodies, _metrics = asyncio.run(_probe(_settings(False, False)))
    assert not server.caps.priority and "priority" not in server.body(_req(), [1, 2], 4, 7)
    server, _bodies, _metrics = asyncio.run(_probe(_settings(True, True)))
    assert server.caps.priority and server.body(_req(), [1, 2], 4, 7)["priority"] == 7


def test_a_server_without_sglangs_settings_is_left_as_probed():
    caps = Capabilities(priority=True)
    read_server_settings(caps, {"version": "0.32.0"})  # not SGLang's settings: nothing to read
    assert caps.priority and caps.priority_sign == 1 and caps.kv_tokens is None and caps.page_tokens is None
    read_server_settings(caps, {"enable_priority_scheduling": True, "page_size": 0, "max_total_num_tokens": "x"})
    assert caps.kv_tokens is None and caps.page_tokens is None  # nonsense is not a capacity
