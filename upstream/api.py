"""Talking to an upstream engine: an OpenAI-compatible server (vLLM, SGLang, `transformers serve`)
that runs the rows cohort schedules. The rows' streams are read on bare connections
(``upstream.sse_client``: a protocol parsing as bytes arrive); one ``aiohttp.ClientSession`` serves
the rest (the model list, /health, /metrics, SGLang's settings). Not httpx: streaming a
row cost the worker ~5.2 ms of CPU on it against aiohttp's ~1.8 ms (32 tokens in chunks of 4;
docs/notes/upstream.md), on a core the worker shares with the gateway and the batcher.

What a server can do is found once, at start, by ``probe`` — not guessed from its name:

* ``token_ids``: it takes the prompt as token ids and streams the generated ids back (vLLM's
  ``return_token_ids``), so cohort tokenizes once and a continuation resumes from exact ids.
  Otherwise the prompt goes as text and each streamed chunk is one token whose ids cohort's own
  tokenizer gives (the same model's tokenizer: COHORT_MODEL).
* fields it refuses: a server that answers 422 naming unexpected fields (``transformers serve``)
  gets requests without them; ``ignore_eos`` and ``priority`` are the ones that matter.
* ``priority``: vLLM refuses a non-zero priority unless it runs ``--scheduling-policy priority``.
* ``stream_interval``: a token-ids server is asked to send a row's tokens in chunks of that many
  (vLLM's per-request field; its first token and its end still come at once). The worker coalesces
  tokens for its flush anyway, and every chunk costs the server and the worker a JSON round. A
  server without token ids streams one token a chunk, which its text-only path relies on.

* SGLang's own settings (``/server_info``, the older ``/get_server_info``): whether it runs priority
  scheduling at all (it ignores a ``priority`` it does not use instead of refusing it), which way its
  priority goes (larger values first unless ``--schedule-low-priority-values-first``; cohort's are
  vLLM's, smaller first, so they go negated there), its KV pool and its page size.

Capacity comes from vLLM's ``/metrics`` (``vllm:cache_config_info``: num_gpu_blocks × block_size) or
SGLang's (``sglang:max_total_num_tokens``, with ``--enable-metrics``) where it is published
(``kv_tokens_from_metrics``), else from SGLang's settings; the server's queue from the same page
(``queue_from_metrics``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from cohort.types import ProfiledRequest
from upstream.chunks import Chunk, UpstreamDown, UpstreamRefused
from upstream.sse_client import SSEClient

log = logging.getLogger(__name__)

# the fields a row's request may carry beyond the standard completions fields (vLLM's extras)
EXTRA_FIELDS = ("ignore_eos", "return_token_ids", "priority", "top_k", "repetition_penalty", "stream_interval")


@dataclass
class Capabilities:
    """What ``probe`` found the server does."""

    token_ids: bool = False
    refused: set[str] = field(default_factory=set)  # fields it answers 422 to: never sent
    priority: bool = True
    logprobs: bool = False
    priority_sign: int = 1             # -1: the server runs larger priority values first (SGLang's default)
    kv_tokens: int | None = None       # its KV pool in tokens, where its settings say (SGLang)
    max_model_len: int | None = None   # its context length: /v1/models (vLLM), its settings (SGLang)
    page_tokens: int | None = None     # its KV page in tokens, where its settings say (SGLang)

    def describe(self) -> str:
        order = "" if self.priority_sign > 0 else " (negated: larger values run first there)"
        return (f"prompt as {'token ids' if self.token_ids else 'text'}, "
                f"priority {'on' if self.priority else 'off'}{order}, "
                f"logprobs {'yes' if self.logprobs else 'no'}, refuses {sorted(self.refused) or 'nothing'}")


_UNEXPECTED = re.compile(r"[Uu]nexpected fields[^{]*\{([^}]*)\}")
_INFO = re.compile(r'^vllm:cache_config_info\{([^}]*)\}', re.M)


def block_tokens_from_metrics(text: str) -> int | None:
    """The server's KV block (page) size in tokens, from ``vllm:cache_config_info``."""
    m = _INFO.search(text)
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1))) if m else {}
    return int(labels["block_size"]) if labels.get("block_size", "").isdigit() else None


def kv_tokens_from_metrics(text: str) -> int | None:
    """KV tokens the server holds: vLLM's usable blocks (num_gpu_blocks less its null block) × block_size from ``vllm:cache_config_info``
    (the override, ``--num-gpu-blocks-override``, when set), SGLang's ``max_total_num_tokens``. None
    when neither is published."""
    m = _INFO.search(text)
    if not m:
        sglang = gauge(text, "sglang:max_total_num_tokens")  # summed over its data-parallel ranks
        return int(sglang) if sglang else None
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    try:
        blocks = labels.get("num_gpu_blocks_override")
        blocks = int(blocks) if blocks not in (None, "", "None") else int(labels["num_gpu_blocks"])
        return max(0, blocks - 1) * int(labels["block_size"])  # vLLM keeps its first block as the null block
    except (KeyError, ValueError):
        return None


def queue_from_metrics(text: str) -> float | None:
    """Requests waiting in the server's own queue: vLLM's ``num_requests_waiting``, SGLang's
    ``num_queue_reqs``; None when it publishes neither."""
    vllm = gauge(text, "vllm:num_requests_waiting")
    return vllm if vllm is not None else gauge(text, "sglang:num_queue_reqs")


def read_server_settings(caps: Capabilities, info: dict[str, Any]) -> None:
    """What SGLang's ``/server_info`` says of its priority, its KV pool and its page (see the module
    docstring); a server whose settings do not name ``enable_priority_scheduling`` is left as probed."""
    if "enable_priority_scheduling" in info:
        caps.priority = caps.priority and bool(info["enable_priority_scheduling"])
        caps.priority_sign = 1 if info.get("schedule_low_priority_values_first") else -1
    pool = info.get("max_total_num_tokens")
    if isinstance(pool, int) and pool > 0:
        caps.kv_tokens = pool
    page = info.get("page_size")
    if isinstance(page, int) and page > 0:
        caps.page_tokens = page
    context = info.get("context_length")
    if caps.max_model_len is None and isinstance(context, int) and context > 0:
        caps.max_model_len = context


def gauge(text: str, name: str) -> float | None:
    """The sum of a Prometheus gauge's samples (every label set), None when absent."""
    vals = [float(v) for v in re.findall(rf'^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.eE+-]+)$', text, re.M)]
    return sum(vals) if vals else None


def refused_fields(body: str) -> set[str]:
    """Field names a 422 body says the server does not accept (``transformers serve``'s wording)."""
    m = _UNEXPECTED.search(body)
    return {f.strip().strip("'\"") for f in m.group(1).split(",")} if m else set()


def auth_headers(api_key: str | None) -> dict[str, str]:
    """What every request to an upstream server carries (``COHORT_UPSTREAM_API_KEY``): the upstream
    worker's and the gateway's streams alike."""
    return {"authorization": f"Bearer {api_key}"} if api_key else {}


class UpstreamServer:
    """One upstream server: its model, what it accepts, and the streams of its rows."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None,
                 timeout_s: float = 60.0, max_connections: int = 64, stream_interval: int = 1) -> None:
        self.base_url = base_url.rstrip("/")
        self.stream_interval = stream_interval
        self.root = self.base_url[:-3] if self.base_url.endswith("/v1") else self.base_url
        self.model = model
        self.caps = Capabilities()
        self._headers = auth_headers(api_key)
        self.timeout_s = timeout_s
        self._max_connections = max_connections
        self._http: aiohttp.ClientSession | None = None  # the model list, /health, /metrics
        self._sse: SSEClient | None = None                # the rows' streams

    @property
    def chunk_tokens(self) -> int:
        """Tokens a row's stream sends per chunk after its first: ``stream_interval`` where the
        server streams ids and takes the field (a text-only server's path reads one token a chunk).
        Up to one less than this the server has generated and holds in KV before cohort hears of
        them, which admission must count (``upstream.rows.Row.held_context``)."""
        chunked = self.caps.token_ids and "stream_interval" not in self.caps.refused
        return self.stream_interval if chunked and self.stream_interval > 1 else 1

    def _session(self) -> aiohttp.ClientSession:
        """The connection pool, made on first use in the event loop that uses it (``close`` ends it,
        and the next use on another loop makes a new one: the start-up probe runs on its own)."""
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                headers=self._headers, connector=aiohttp.TCPConnector(limit=self._max_connections))
        return self._http

    def _streams(self) -> SSEClient:
        """The rows' streams' connections, made on first use like the session."""
        if self._sse is None:
            self._sse = SSEClient(headers=self._headers, read_timeout_s=self.timeout_s)
        return self._sse

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None
        if self._sse is not None:
            await self._sse.aclose()
            self._sse = None

    async def _get(self, url: str, timeout_s: float) -> tuple[int, str]:
        async with self._session().get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as r:
            return r.status, await r.text()

    async def healthy(self) -> bool:
        try:
            return (await self._get(f"{self.root}/health", 10.0))[0] == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def metrics(self) -> str | None:
        try:
            status, text = await self._get(f"{self.root}/metrics", 5.0)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None
        return text if status == 200 else None

    async def settings(self) -> dict[str, Any]:
        """SGLang's server settings (``/server_info``, or ``/get_server_info`` before it was renamed);
        empty for a server that has neither (vLLM, ``transformers serve``)."""
        for path in ("/server_info", "/get_server_info"):
            try:
                status, text = await self._get(f"{self.root}{path}", 10.0)
                info = json.loads(text) if status == 200 else None
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
                continue
            if isinstance(info, dict):
                return info
        return {}

    async def discover_model(self) -> str:
        """The model id to send: the configured one, else the first the server lists; and that
        model's context length where the server lists it (vLLM's ``max_model_len``)."""
        try:
            status, text = await self._get(f"{self.base_url}/models", 10.0)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise UpstreamDown(f"{self.base_url}/models: {type(e).__name__}: {e}") from e
        if status != 200:
            raise UpstreamDown(f"{self.base_url}/models answered {status}: {text[:200]}")
        data = json.loads(text).get("data") or []
        if not data:
            raise UpstreamDown(f"{self.base_url}/models lists no model")
        card = next((m for m in data if self.model in (m.get("id"), m.get("root"))), None) if self.model else data[0]
        self.model = self.model or data[0]["id"]
        context = (card or {}).get("max_model_len")
        if isinstance(context, int) and context > 0:
            self.caps.max_model_len = context
        return self.model

    async def probe(self, prompt_ids: list[int], prompt_text: str) -> Capabilities:
        """Find what the server does with one-token requests (see the module docstring)."""
        caps = self.caps
        body = {"prompt": prompt_ids, "max_tokens": 1, "return_token_ids": True, "ignore_eos": True,
                "logprobs": 1, "priority": 1, "stream_interval": max(1, self.stream_interval)}
        for _ in range(len(EXTRA_FIELDS) + 3):
            sent = {k: v for k, v in body.items() if k not in caps.refused}
            try:
                chunks = [c async for c in self.stream(sent)]
            except UpstreamRefused as e:
                msg = str(e)
                named = refused_fields(msg)
                if named:
                    caps.refused |= named
                elif "priority" in msg.lower() and "priority" not in caps.refused:
                    caps.priority = False
                    caps.refused.add("priority")
                elif isinstance(body["prompt"], list):
                    body["prompt"] = prompt_text  # it takes text prompts only
                elif "logprobs" not in caps.refused:
                    caps.refused.add("logprobs")
                else:
                    raise
                continue
            caps.token_ids = isinstance(sent["prompt"], list) and any(c.ids is not None for c in chunks)
            caps.logprobs = "logprobs" not in caps.refused and any(c.logprobs for c in chunks)
            caps.priority = caps.priority and "priority" not in caps.refused
            read_server_settings(caps, await self.settings())
            return caps
        raise UpstreamDown(f"{self.base_url} refused every form of a one-token completion")

    def body(self, req: ProfiledRequest, prompt: list[int] | str, max_tokens: int, priority: int | None) -> dict:
        """A row's request: its prompt, token budget and sampling, as far as the server takes them."""
        s = req.sampling
        b: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": s.temperature,
                             "top_p": s.top_p}
        if s.seed is not None:
            b["seed"] = s.seed
        if s.stop:
            b["stop"] = list(s.stop)
        if s.presence_penalty:
            b["presence_penalty"] = s.presence_penalty
        if s.frequency_penalty:
            b["frequency_penalty"] = s.frequency_penalty
        if s.logit_bias:
            b["logit_bias"] = {str(k): v for k, v in s.logit_bias}
        if s.logprobs is not None:
            b["logprobs"] = s.logprobs
        if s.top_k:
            b["top_k"] = s.top_k
        if s.repetition_penalty != 1.0:
            b["repetition_penalty"] = s.repetition_penalty
        if s.ignore_eos or req.emulated_tokens is not None:
            b["ignore_eos"] = True
        if self.caps.token_ids:
            b["return_token_ids"] = True
        if priority is not None and self.caps.priority:
            b["priority"] = priority * self.caps.priority_sign
        if self.chunk_tokens > 1:
            b["stream_interval"] = self.chunk_tokens
        return b  # ``stream`` leaves out what the server refuses

    def payload(self, body: dict[str, Any]) -> dict[str, Any]:
        """The whole streamed request for ``body``: the model, streaming with usage, and nothing the
        server refuses."""
        payload = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        return {k: v for k, v in payload.items() if k not in self.caps.refused}

    async def stream(self, body: dict[str, Any]) -> AsyncIterator[Chunk]:
        """Stream one completion (``SSEClient.chunks``: closing the iterator closes the connection,
        and vLLM aborts the request)."""
        async for ch in self._streams().chunks(f"{self.base_url}/completions", self.payload(body)):
            yield ch


def finish_reason(reason: str | None, generated: int, max_tokens: int, emulated: int | None) -> str:
    """A row's finish reason from its server's: "length" is the server's unless an emulated length
    (a benchmark's stand-in for EOS) ended it short of max_tokens — then "stop", as the built-in engine
    says; "length" short of max_tokens otherwise is the server's context end, and stays."""
    if reason == "length" and emulated is not None and emulated <= generated < max_tokens:
        return "stop"
    return "length" if reason == "length" else "stop"
