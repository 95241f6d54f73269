"""Schemathesis over the OpenAPI document, bounded: the real gateway app (served by uvicorn in a
thread, on fakeredis, with a worker that answers every admitted request at once) must answer
every generated request — valid ones and ones that break the schema — without a 5xx, and every
status it sends must be one the document declares for that route.

Bounded to keep `make test` fast (a few hundred cases; HYPOTHESIS seeds are fixed, so a failure
reproduces). A longer run: ``COHORT_SCHEMATHESIS_EXAMPLES=500 pytest tests/gateway/test_schemathesis.py``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import Counter
from contextlib import AsyncExitStack

import httpx
import pytest
import uvicorn
from starlette.types import Receive, Scope, Send

from cohort import bus
from gateway.app import create_app
from tests.gateway.harness import answering, wire
from tests.gateway.harness import settings as gateway_settings

EXAMPLES = int(os.environ.get("COHORT_SCHEMATHESIS_EXAMPLES", "40"))


class _WithFakeStack:
    """The app behind its own lifespan: fakeredis state, the batcher's heartbeat (so /health is
    ready) and the answering worker, all in the server's event loop."""

    def __init__(self, app) -> None:
        self.app, self.stack = app, AsyncExitStack()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await wire(self.app)
                st = self.app.state
                await st.redis.set(bus.pool_keys(st.settings.pool).batcher_lock, "test")
                await self.stack.enter_async_context(answering(st.redis))
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await self.stack.aclose()
                self.app.state.predictor.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """One gateway for the module (each xdist worker starts its own)."""
    app = create_app(gateway_settings(tmp_path_factory.mktemp("gw"), request_timeout_s=10, max_text_chars=20_000))
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(_WithFakeStack(app), host="127.0.0.1", port=port, log_level="error",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 30
    while not server.started:
        assert time.time() < deadline, "the gateway did not start"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(timeout=10)


def test_openapi_declares_what_the_api_answers(served):
    doc = httpx.get(f"{served}/openapi.json").json()
    for path in ("/v1/generate", "/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "422" not in responses
        assert {"200", "400", "429", "503", "504", "507"} <= set(responses), (path, sorted(responses))
        assert "Retry-After" in responses["429"]["headers"]
        props = doc["components"]["schemas"][doc["paths"][path]["post"]["requestBody"]["content"][
            "application/json"]["schema"]["$ref"].rsplit("/", 1)[1]]["properties"]
        assert "priority" in props
    assert "404" in doc["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    assert "ErrorResponse" in doc["components"]["schemas"] and "HTTPValidationError" not in doc["components"]["schemas"]


# Every operation of the document, fuzzed as a test of its own (a failure names its route);
# test_every_operation_is_fuzzed keeps this list equal to what the gateway serves.
OPERATIONS = ["POST /v1/generate", "POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
              "GET /v1/models/{model_id}", "GET /health", "GET /metrics",
              # the Batch API (issue 21)
              "POST /v1/files", "GET /v1/files", "GET /v1/files/{file_id}", "GET /v1/files/{file_id}/content",
              "DELETE /v1/files/{file_id}", "POST /v1/batches", "GET /v1/batches", "GET /v1/batches/{batch_id}",
              "POST /v1/batches/{batch_id}/cancel"]


@pytest.fixture(scope="module")
def schema(served):
    schemathesis = pytest.importorskip("schemathesis")  # heavy: imported by the tests, not at collection
    return schemathesis.openapi.from_url(f"{served}/openapi.json")


@pytest.mark.slow  # only keeps the fuzzed list below whole; imports schemathesis (seconds)
def test_every_operation_is_fuzzed(schema):
    assert sorted(r.ok().label for r in schema.get_all_operations()) == sorted(OPERATIONS)


def _fuzz(op, mode, url: str, seen: Counter, errors: list[str], undeclared: list[str]) -> None:
    """Up to EXAMPLES cases of one operation in one mode (a ``schemathesis.GenerationMode``); an
    operation with nothing to break (no parameters, no body) has no negative cases."""
    # schemathesis and hypothesis take over a second to import: only in the tests that fuzz
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    declared = set(op.definition.raw.get("responses", {}))

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def run(case) -> None:
        r = case.call(base_url=url, timeout=30)
        seen[(mode.value, r.status_code)] += 1
        where = f"{op.label} {r.status_code}: {case.body!r:.300} -> {r.text[:300]}"
        if r.status_code >= 500:
            errors.append(where)
        if str(r.status_code) not in declared:
            undeclared.append(where)

    try:
        run()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE, op.label


@pytest.mark.slow  # 2 x EXAMPLES generated requests per operation: seconds each (make test runs them)
@pytest.mark.parametrize("label", OPERATIONS)
def test_schemathesis_finds_no_server_error(served, schema, label):
    from schemathesis import GenerationMode

    op = next(r.ok() for r in schema.get_all_operations() if r.ok().label == label)
    seen: Counter[tuple[str, int]] = Counter()
    errors: list[str] = []
    undeclared: list[str] = []
    for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
        _fuzz(op, mode, served, seen, errors, undeclared)
    total = sum(seen.values())
    print(f"schemathesis {label}: {total} cases, statuses {dict(sorted(seen.items()))}")
    assert sum(n for (mode, _), n in seen.items() if mode == GenerationMode.POSITIVE.value) >= 1
    assert not errors, f"{len(errors)} × 5xx of {total}: {errors[:5]}"
    assert not undeclared, f"{len(undeclared)} statuses not in the document: {undeclared[:5]}"
