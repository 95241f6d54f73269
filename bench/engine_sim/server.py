"""The simulator's HTTP face: vLLM's OpenAI-compatible routes on aiohttp.

aiohttp rather than FastAPI: the fixed-delay engine shares a core with the benchmark client and
the front being measured, and a route here is a plain coroutine over the raw body, with no
validation layer per request. Bodies are checked by hand, for what the simulator uses.

Routes: ``GET /v1/models`` (with ``max_model_len``), ``POST /v1/completions`` and
``/v1/chat/completions`` (streamed and whole), ``GET /health``, ``GET /metrics``. What a request
may carry beyond the prompt: ``max_tokens`` (chat: also ``max_completion_tokens``; unset: up to
``max_model_len``), ``stream``, ``stream_options.include_usage``, ``return_token_ids``,
``priority`` (refused unless ``--scheduling-policy priority``, as vLLM does), ``stream_interval``
(vLLM's per-request chunking of a stream), ``seed``. Sampling fields, ``stop`` and
``ignore_eos`` are accepted and ignored: every request generates exactly its token budget, as
with ``ignore_eos`` (a simulator has no EOS to meet). ``n`` above 1 and batched prompts are
refused.

A client that disconnects aborts its request (the handler is cancelled; the engine frees its
blocks), as vLLM does. With ``--api-key`` (vLLM's too), a ``/v1`` route without
``Authorization: Bearer KEY`` answers 401 ``{"error": "Unauthorized"}``; ``/health`` and
``/metrics`` stay open, as vLLM's do.
"""

from __future__ import annotations

import hmac
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from bench.engine_sim.config import SimConfig
from bench.engine_sim.engine import SteppedEngine
from bench.engine_sim.fixed import FixedDelayEngine
from bench.engine_sim.metrics import SimMetrics
from bench.engine_sim.request import SimRequest
from bench.engine_sim.tokens import TokenTable, request_seed
from bench.engine_sim.wire import DONE, Reply, error_body

log = logging.getLogger(__name__)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


class BadRequest(ValueError):
    """A body the simulator refuses with 400 (vLLM's wording where it has one)."""


@dataclass
class SimBody:
    prompt_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    priority: int
    stream_interval: int
    seed: int | None


def _json_error(status: int, message: str, kind: str) -> web.Response:
    return web.json_response(error_body(message, kind, status), status=status)


class SimServer:
    """The app's state: the engine, the tokenizer table, the metrics, the options."""

    def __init__(self, cfg: SimConfig, engine: SteppedEngine | FixedDelayEngine, tokens: TokenTable) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokens = tokens
        self.faults = engine.faults
        blocks = engine.kv.pool.num_blocks if isinstance(engine, SteppedEngine) else 0
        self.metrics = SimMetrics(cfg.model_name, cfg.block_size, blocks, cfg.speedup, engine.gauges)
        engine.metrics = self.metrics
        self._ids = itertools.count(1)
        self._uid = f"{int(time.time()) % 100000:05d}"

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20, middlewares=[self._auth] if self.cfg.api_key else [])
        app.router.add_get("/v1/models", self.models)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.prometheus)
        app.on_cleanup.append(self._cleanup)
        return app

    @web.middleware
    async def _auth(self, request: web.Request, handler: Any) -> web.StreamResponse:
        """vLLM's rule: every ``/v1`` path but an OPTIONS asks for the bearer key."""
        expected = f"Bearer {self.cfg.api_key}".encode()
        given = request.headers.get("Authorization", "").encode()
        if request.method != "OPTIONS" and request.path.startswith("/v1") and not hmac.compare_digest(given, expected):
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)

    async def _cleanup(self, _app: web.Application) -> None:
        await self.engine.stop()

    # --- plain routes --------------------------------------------------------------------------
    async def health(self, _request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def prometheus(self, _request: web.Request) -> web.Response:
        return web.Response(text=self.metrics.render(), content_type="text/plain")

    async def models(self, _request: web.Request) -> web.Response:
        card = {"id": self.cfg.model_name, "object": "model", "created": int(time.time()), "owned_by": "vllm",
                "root": self.cfg.model_name, "parent": None, "max_model_len": self.cfg.max_model_len,
                "permission": [], "engine_sim": {"speedup": self.cfg.speedup, **self.engine.describe()}}
        return web.json_response({"object": "list", "data": [card]})

    # --- generation ----------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    def parse(self, body: Any, chat: bool) -> SimBody:
        if not isinstance(body, dict):
            raise BadRequest("the body must be a JSON object")
        model = body.get("model")
        if model is not None and model != self.cfg.model_name:
            raise LookupError(f"The model `{model}` does not exist.")
        if int(body.get("n") or 1) != 1:
            raise BadRequest("the simulator answers n=1 only")
        if chat:
            msgs = body.get("messages")
            if not isinstance(msgs, list) or not msgs:
                raise BadRequest("'messages' must be a non-empty list")
            ids = self.tokens.chat_prompt(msgs)
            max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
        else:
            ids = self._prompt_ids(body.get("prompt"))
            max_tokens = body.get("max_tokens")
        room = self.cfg.max_model_len - len(ids)
        if room < 1:
            raise BadRequest(f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, "
                             f"your request has {len(ids)} input tokens. Please reduce the length of the input.")
        if max_tokens is None:
            max_tokens = room
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise BadRequest("max_tokens must be at least 1")
        priority = body.get("priority") or 0
        if not isinstance(priority, int):
            raise BadRequest("priority must be an integer")
        if priority != 0 and self.cfg.scheduling_policy != "priority":
            raise BadRequest(f"Got priority {priority} but Priority scheduling is not enabled.")
        opts = body.get("stream_options") or {}
        seed = body.get("seed")
        return SimBody(ids, min(max_tokens, room), bool(body.get("stream")), bool(opts.get("include_usage")),
                      bool(body.get("return_token_ids")), priority, max(1, int(body.get("stream_interval") or 1)),
                      seed if isinstance(seed, int) else None)

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]    # a batch of one
        if isinstance(prompt, str):
            ids = self.tokens.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            if any(t < 0 or t >= self.tokens.vocab_size for t in prompt):
                raise BadRequest(f"token ids must be within [0, {self.tokens.vocab_size})")
            ids = list(prompt)
        else:
            raise BadRequest("'prompt' must be a string or a list of token ids (batched prompts are not simulated)")
        if not ids:
            raise BadRequest("the prompt is empty")
        return ids

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        try:
            p = self.parse(json.loads(await request.read()), chat)
        except LookupError as e:
            return _json_error(404, str(e), "NotFoundError")
        except (BadRequest, ValueError, TypeError) as e:
            return _json_error(400, str(e), "BadRequestError")
        if self.faults.draw_error():
            self.metrics.errors += 1
            return _json_error(500, "injected failure (--error-rate)", "InternalServerError")
        if self.engine.full():
            self.metrics.rejected += 1
            return _json_error(429, f"the server's waiting queue is full ({self.cfg.max_waiting})",
                               "RateLimitError")
        index = self.faults.admit()
        n = next(self._ids)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-sim{self._uid}-{n}"
        req = SimRequest(rid, p.prompt_ids, p.max_tokens,
                         self.tokens.drawer(request_seed(self.cfg.seed, p.prompt_ids, p.seed)), priority=p.priority)
        reply = Reply(chat, rid, int(time.time()), self.cfg.model_name, p.return_token_ids, p.prompt_ids)
        tokens = self.engine.submit(req)
        done = False
        try:
            if p.stream:
                resp = await self._stream(request, p, req, reply, tokens, index)
            else:
                resp = await self._whole(p, req, reply, tokens, index)
            done = True
            return resp
        finally:
            if not done:
                self.engine.abort(req)
            await tokens.aclose()

    async def _stream(self, request: web.Request, p: SimBody, req: SimRequest, reply: Reply, tokens: Any,
                      index: int) -> web.StreamResponse:
        resp = web.StreamResponse(headers=SSE_HEADERS)
        await resp.prepare(request)
        first = reply.first_chunk()
        if first is not None:
            await resp.write(first)
        dies = self.faults.dies_at(index)
        held: list[int] = []
        sent_any = False
        esc = self.tokens.escaped_of
        async for ids, finish in tokens:
            held.extend(ids)
            if finish is None and sent_any and len(held) < p.stream_interval:
                continue
            await resp.write(reply.chunk(esc(held), held, finish))
            held = []
            if dies:
                self.faults.die()
            sent_any = True
        if p.include_usage:
            await resp.write(reply.usage_chunk(req.num_prompt_tokens, req.num_output_tokens, req.num_cached_tokens))
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _whole(self, p: SimBody, req: SimRequest, reply: Reply, tokens: Any, index: int) -> web.Response:
        dies = self.faults.dies_at(index)
        async for _ids, _finish in tokens:
            if dies:
                self.faults.die()
        out = req.output_ids
        body = reply.whole(self.tokens.text_of(out), out, "length", req.num_cached_tokens)
        return web.json_response(body)


async def start_server(server: SimServer, host: str = "127.0.0.1", port: int = 0) -> tuple[web.AppRunner, int]:
    """Serve on ``host:port`` (0: a free port); returns the runner (``cleanup()`` stops it) and the
    port. Handler cancellation is on: a client's disconnect cancels its handler, which aborts its
    request."""
    runner = web.AppRunner(server.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    sock = site._server.sockets[0]  # type: ignore[union-attr]
    return runner, sock.getsockname()[1]
