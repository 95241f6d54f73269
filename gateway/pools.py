"""The models this deployment serves, one per pool, as the gateway learns them from Redis.

A pool is one model: its own batcher (``COHORT_POOL``), Celery queue and Redis keys. Every worker
registers an ``InstanceInfo`` naming its pool, the model it loaded and the pool's served model
name (``COHORT_SERVED_MODEL_NAME``, else the model path); the gateway lists every pool that has a
registered instance, plus its own default pool (from its settings), so ``GET /v1/models`` shows
the default model before its first worker is up (requests then get 503, not 404).

A request's ``model`` names a pool by its served model name or by the pool's name; an omitted
model means the default pool; anything else is 404 ``model_not_found``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from cohort import bus
from cohort.sampling_defaults import sampling_defaults
from cohort.settings import Settings
from cohort.types import InstanceInfo
from gateway.errors import APIError

log = logging.getLogger("cohort.gateway")

CACHE_S = 1.0  # how stale the view of the instances may be (admission reads it per request)


@dataclass(frozen=True)
class ServedModel:
    """One pool as clients see it."""

    id: str                   # the OpenAI ``model`` id
    pool: str
    path: str                 # what the pool's workers load; its tokenizer counts L(p)
    created: int
    max_model_len: int        # prompt + generated tokens one request may reach

    def card(self) -> dict:
        """The OpenAI model object (plus vLLM's ``max_model_len``, cohort's ``pool``, and the
        sampling a request gets for the fields it leaves out, with where they came from)."""
        return {"id": self.id, "object": "model", "created": self.created, "owned_by": "cohort",
                "root": self.path, "parent": None, "max_model_len": self.max_model_len, "pool": self.pool,
                "sampling_defaults": sampling_defaults(self.path).card()}


class PoolView:
    """The registered instances of every pool, cached for ``CACHE_S`` seconds."""

    def __init__(self, settings: Settings, redis) -> None:
        self.settings, self.redis = settings, redis
        self._at = 0.0
        self._registered: list[InstanceInfo] = []
        self._alive: set[str] = set()
        self._started = int(time.time())
        self._reading: asyncio.Future | None = None  # the read under way: requests that find the view stale share it

    async def _refresh(self, force: bool = False) -> None:
        """Re-read the view when it is stale (``force``: now). One read at a time: in a burst every
        waiting request found it stale at once, and each read it again (8x the reads needed)."""
        if not force and time.monotonic() - self._at <= CACHE_S:
            return
        if force or self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        await asyncio.shield(self._reading)  # a caller that leaves does not cancel the others' read

    async def _read(self) -> None:
        infos = [InstanceInfo.from_dict(json.loads(js)) for js in (await self.redis.hgetall(bus.INSTANCES)).values()]
        pipe = self.redis.pipeline()
        for info in infos:
            pipe.exists(bus.alive_key(info.name))
        hits = await pipe.execute() if infos else []
        self._registered = infos
        self._alive = {i.name for i, hit in zip(infos, hits, strict=True) if hit}
        self._at = time.monotonic()

    async def alive(self, pool: str | None = None) -> list[InstanceInfo]:
        """The heart-beating instances of ``pool`` (default: the gateway's own pool)."""
        await self._refresh()
        pool = self.settings.pool if pool is None else pool
        return [i for i in self._registered if i.pool == pool and i.name in self._alive]

    def max_model_len(self, alive: list[InstanceInfo]) -> int:
        """The pool's context length: prompt + generated tokens one request may reach. The request
        limits, no more than one instance's KV memory holds for one request, and no more than the
        smallest context of its live instances (an upstream's own ``max_model_len``, the built-in
        model's positions): a request planned past it would be cut short by the engine."""
        limit = self.settings.max_input_tokens + self.settings.max_tokens_limit
        fits = [i.theta_bytes // i.delta_bytes for i in alive if i.delta_bytes > 0]
        contexts = [i.max_model_len for i in alive if i.max_model_len > 0]
        return min([limit, *fits, *contexts])

    async def models(self) -> list[ServedModel]:
        """Every served model: the default pool first, then the others by name. Two pools that
        claim the same served name keep it for the first; the other is listed by its pool name."""
        await self._refresh()
        s = self.settings
        paths = {s.pool: (s.served_model_name or s.model, s.model)}
        created = {s.pool: self._started}
        for info in sorted(self._registered, key=lambda i: i.started):  # the newest registration wins
            if info.pool != s.pool:
                paths[info.pool] = (info.served_model_name or info.model, info.model)
            created[info.pool] = min(created.get(info.pool, int(info.started)), int(info.started))
        out: list[ServedModel] = []
        taken: set[str] = set()
        for pool in [s.pool, *sorted(p for p in paths if p != s.pool)]:
            name, path = paths[pool]
            if name in taken:
                log.warning("pools share the served model name %r; pool %r is listed as %r", name, pool, pool)
                name = pool
            taken.add(name)
            out.append(ServedModel(name, pool, path, created[pool], self.max_model_len(await self.alive(pool))))
        return out

    async def resolve(self, name: str | None) -> ServedModel:
        """The pool a request's ``model`` names (None: the default pool), or 404. A name not in
        the cached view is looked up once more in Redis: a pool that just registered is served."""
        models = await self.models()
        if name is None:
            return models[0]
        for attempt in range(2):
            if attempt:
                await self._refresh(force=True)
                models = await self.models()
            for m in models:
                if name == m.id:
                    return m
            for m in models:
                if name == m.pool:
                    return m
        raise APIError(404, f"the model {name!r} does not exist; served models: "
                       f"{', '.join(m.id for m in models)} (GET /v1/models)", code="model_not_found", param="model")
