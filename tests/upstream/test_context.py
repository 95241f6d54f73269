"""An upstream says its own context and finish reasons: its ``max_model_len`` is read from its
``/v1/models`` (vLLM) or its settings (SGLang's ``context_length``), and a row it ends with
``"length"`` short of ``max_tokens`` (its context's end) stays ``"length"``; only an emulated
length (a benchmark's stand-in for EOS) reads as ``"stop"``, as the built-in engine says."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from cohort.protocol import FinishReason
from cohort.tokenizer import load_tokenizer
from cohort.types import Batch, ProfiledRequest
from tests.loopback import answer, serving
from tests.upstream.test_admission import ScriptedServer, _run
from upstream.admission import UpstreamLoop
from upstream.api import Capabilities, UpstreamServer, read_server_settings


async def _discover(cards: list[dict], model: str | None) -> UpstreamServer:
    app = web.Application()
    app.router.add_get("/v1/models", answer(lambda: web.json_response({"object": "list", "data": cards})))
    async with serving(app) as url:
        server = UpstreamServer(url, model=model)
        try:
            await server.discover_model()
        finally:
            await server.close()
    return server


def test_the_servers_context_comes_from_its_model_card():
    cards = [{"id": "other", "max_model_len": 512}, {"id": "m", "root": "/models/m", "max_model_len": 2048}]
    first = asyncio.run(_discover(cards, None))
    assert first.model == "other" and first.caps.max_model_len == 512
    named = asyncio.run(_discover(cards, "m"))
    assert named.model == "m" and named.caps.max_model_len == 2048
    by_root = asyncio.run(_discover(cards, "/models/m"))
    assert by_root.caps.max_model_len == 2048
    silent = asyncio.run(_discover([{"id": "m"}], None))  # transformers serve lists no context
    assert silent.caps.max_model_len is None


def test_sglangs_context_length_is_read_from_its_settings():
    caps = Capabilities()
    read_server_settings(caps, {"context_length": 4096})
    assert caps.max_model_len == 4096
    caps = Capabilities(max_model_len=2048)  # what /v1/models said stands
    read_server_settings(caps, {"context_length": 4096})
    assert caps.max_model_len == 2048


class ContextEndServer(ScriptedServer):
    """Ends every row with "length" after ``room`` tokens, whatever its max_tokens: a context's end."""

    def __init__(self, room: int) -> None:
        super().__init__()
        self.room = room

    async def stream(self, body):
        async for ch in super().stream({**body, "max_tokens": min(body["max_tokens"], self.room)}):
            yield ch


def _finish_reasons(server: ScriptedServer, reqs: list[ProfiledRequest]) -> dict[str, tuple[int, str]]:
    loop = UpstreamLoop(server, load_tokenizer(), capacity_tokens=4000, page_tokens=16, poll_s=60)
    try:
        got = _run(loop, [Batch("b", reqs, time.time())])
    finally:
        loop.stop()
    return {res.request.id: (res.tokens, res.finish_reason) for u in got["b"] for res in u.out.finished}


def _req(rid: str, max_tokens: int, emulated: int | None = None) -> ProfiledRequest:
    return ProfiledRequest(id=rid, prompt="hi", input_tokens=3, predicted_tokens=max_tokens, max_tokens=max_tokens,
                           arrival=time.time(), emulated_tokens=emulated)


def test_the_servers_length_short_of_max_tokens_stays_length_and_an_emulated_end_is_stop():
    got = _finish_reasons(ContextEndServer(room=6), [_req("ctx", 20), _req("full", 4)])
    assert got == {"ctx": (6, FinishReason.LENGTH), "full": (4, FinishReason.LENGTH)}
    got = _finish_reasons(ScriptedServer(), [_req("emu", 20, emulated=5), _req("emu-full", 5, emulated=5)])
    assert got == {"emu": (5, FinishReason.STOP), "emu-full": (5, FinishReason.LENGTH)}
