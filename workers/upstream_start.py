"""Starting an upstream instance (COHORT_UPSTREAM): no model is loaded; the worker finds the
server's model, what it accepts and its KV capacity, and advertises itself in its pool like any
instance — Θ and Δ in the same units, so ``batcher.memory.KVMemory.for_pool`` mixes it with
built-in instances — withdrawing itself while the server is down.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import threading
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

from batcher.memory import kv_bytes_per_token
from cohort import bus
from cohort.logdb import get_db_engine
from cohort.settings import DEFAULT_MODEL, Settings
from cohort.tokenizer import load_tokenizer, prompt_token_ids
from cohort.types import InstanceInfo, ProfiledRequest
from upstream.admission import UpstreamLoop
from upstream.api import (
    UpstreamServer,
    block_tokens_from_metrics,
    kv_tokens_from_metrics,
)
from upstream.chunks import UpstreamDown
from upstream.group_intake import GroupSource
from upstream.release import ReleaseLink
from workers.group_publisher import GroupPublisher
from workers.reporting import queue_admission_marks
from workers.runtime import Runtime
from workers.tiny_llama import TINY_LLAMA

log = logging.getLogger(__name__)
START_WAIT_S = 300.0  # how long a starting worker waits for its server to answer


class UpstreamPrompts:
    """The one engine duty an upstream instance keeps: a request's prompt ids, counted by the
    same tokenizer as the gateway (the server's model's: COHORT_MODEL)."""

    def __init__(self, model: str) -> None:
        self.model = model

    def request_prompt_ids(self, req: ProfiledRequest) -> list[int]:
        return list(req.prompt_ids) if req.prompt_ids is not None else prompt_token_ids([req.prompt], self.model)[0]


def delta_bytes(model: str) -> int:
    """Δ of the served model, from its config when cohort can read it (the built-in model's
    shape for the default); 1 otherwise — Θ is then in tokens, which is all the rule needs."""
    if model == DEFAULT_MODEL:
        return kv_bytes_per_token({**TINY_LLAMA, "torch_dtype": "float32"})
    config = Path(model) / "config.json"
    try:
        return kv_bytes_per_token(json.loads(config.read_text()))
    except (OSError, ValueError):  # a model id only the server knows, or a config cohort cannot read
        return 1


def context_from_config(model: str) -> int:
    """The served model's positions, from its config where cohort can read it (0: not known): the
    context of a server that does not say its own (``transformers serve``)."""
    if model == DEFAULT_MODEL:
        return int(TINY_LLAMA.get("max_position_embeddings", 0))
    try:
        return int(json.loads((Path(model) / "config.json").read_text()).get("max_position_embeddings") or 0)
    except (OSError, ValueError, TypeError):
        return 0


async def _connect(server: UpstreamServer, probe_ids: list[int], probe_text: str) -> str | None:
    """Wait for the server, then read its model, what it accepts and its published capacity."""
    deadline = time.monotonic() + START_WAIT_S
    try:
        while True:
            try:
                await server.discover_model()
                caps = await server.probe(probe_ids, probe_text)
                log.info("upstream %s serves %s: %s", server.base_url, server.model, caps.describe())
                return await server.metrics()
            except (UpstreamDown, ValueError, KeyError) as e:  # still starting
                if time.monotonic() > deadline:
                    raise UpstreamDown(f"{server.base_url} did not answer in {START_WAIT_S:.0f} s: {e}") from e
                log.info("waiting for upstream %s (%s)", server.base_url, e)
            await asyncio.sleep(2.0)
    finally:
        await server.close()


def start_upstream(settings: Settings) -> Runtime:
    """Connect to the server, register the instance, start its heartbeat."""
    s = settings
    tok = load_tokenizer(s.model)
    server = UpstreamServer(s.upstream, s.upstream_api_key, s.upstream_model, s.upstream_timeout_s,
                            stream_interval=s.upstream_stream_interval)
    probe_text = "Hello"
    # the probe runs on its own event loop and closes its connections; the loop's thread opens its own
    metrics = asyncio.run(_connect(server, prompt_token_ids([probe_text], s.model)[0], probe_text))
    published = (kv_tokens_from_metrics(metrics) if metrics else None) or server.caps.kv_tokens
    capacity = published or s.upstream_kv_tokens or s.continuous.max_rows * (s.max_input_tokens // 4 + 256)
    if not (published or s.upstream_kv_tokens):
        log.warning("upstream %s publishes no KV capacity and COHORT_UPSTREAM_KV_TOKENS is unset: planning with "
                    "%d tokens", s.upstream, capacity)
    block = (block_tokens_from_metrics(metrics) if metrics else None) or server.caps.page_tokens or s.continuous.page_tokens
    name = s.instance_name or f"{socket.gethostname()}-{os.getpid()}-upstream"
    loop = UpstreamLoop(server, tok, capacity, page_tokens=block,
                        max_rows=s.continuous.max_rows, flush_s=s.upstream_flush_s,
                        overcommit=s.upstream_kv_overcommit, take_wait_s=s.upstream_take_wait_s,
                        use_priority=s.upstream_priority == "on" or (s.upstream_priority == "auto" and server.caps.priority),
                        link=ReleaseLink(s.resolved_redis_url, name,  # rows whose gateway streams them
                                         admitted=partial(queue_admission_marks, settings=s, instance=name)))
    delta = delta_bytes(s.model)
    info = InstanceInfo(name=name, pool=s.pool, model=s.model, theta_bytes=capacity * delta, delta_bytes=delta,
                        device=f"upstream:{s.upstream}", started=time.time(),
                        served_model_name=s.served_model_name or s.model,
                        max_model_len=server.caps.max_model_len or context_from_config(s.model), page_tokens=block)

    def status() -> InstanceInfo | None:
        return None if loop.down else replace(info, theta_bytes=loop.capacity_tokens * delta,
                                              page_tokens=loop.page_tokens)

    rt = Runtime(s, UpstreamPrompts(s.model), bus.connect(s.resolved_redis_url), get_db_engine(s.database_url),
                 info, loop=loop, status=status)
    rt.publisher = GroupPublisher(rt, loop)
    rt.start_heartbeat()
    log.info("upstream instance %s registered in pool %s: %d KV tokens (%s), context %s tokens", name, s.pool,
             capacity, "published by the server" if published else "configured", info.max_model_len or "unknown")
    return rt


def start_group_intake(rt: Runtime) -> threading.Event:
    """Take the instance's groups off the pool's sets on its engine loop's thread
    (``upstream.group_intake``: an upstream-only pool's groups come there, not on Celery); set the
    event returned to stop taking them."""
    s, stop = rt.settings, threading.Event()
    rt.loop.start_intake(GroupSource(bus.connect_async(s.resolved_redis_url, max_connections=4), s.pool, rt.name,
                                s.visibility_timeout_s, rt.publisher.register, rt.engine.request_prompt_ids, stop))
    return stop
