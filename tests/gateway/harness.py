"""A real gateway app (real admission, predictor in cold start, tokenizer, SQLite log DB) over
fakeredis, and a fake worker that answers by writing StreamEvents into the request's stream —
exactly what the real worker publishes, so the gateway side is tested without a Redis service."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fakeredis import aioredis

from cohort import bus, engine_counters
from cohort.logdb import get_db_engine
from cohort.protocol import FinishReason, StreamEvent, StreamKind
from cohort.settings import Settings
from cohort.types import InstanceInfo, ProfiledRequest
from gateway.app import create_app
from gateway.submit import PoolView

THETA, DELTA = 1 << 30, 2048
MSG = [{"role": "user", "content": "hi"}]


def post_alone(tmp: Path, path: str, body: dict, **kw) -> tuple[object, httpx.Response, int]:
    """(app, response, requests waiting in the default pool) for one request to a fresh gateway
    (settings ``kw``). The body goes out as raw JSON, so lone surrogates reach the server as such."""
    async def scenario():
        async with gateway(tmp, **kw) as (app, client, redis):
            raw = json.dumps(body).encode("utf-8", "surrogatepass")
            r = await client.post(path, content=raw, headers={"content-type": "application/json"})
            return app, r, await redis.llen(bus.pool_keys("default").incoming)

    return asyncio.run(scenario())


def settings(tmp: Path, **kw) -> Settings:
    kw.setdefault("disconnect_check_s", 0.05)  # a departed client is noticed within 50 ms, not 1 s
    return Settings(_env_file=None, data_dir=tmp / "var", database_url=f"sqlite:///{tmp}/log.db",
                    cold_start="max_tokens", **kw)


@asynccontextmanager
async def gateway(tmp: Path, **kw):
    """(app, client, redis): the app's state set up as its lifespan would, on fakeredis, with one
    live instance registered."""
    app = create_app(settings(tmp, **kw))
    st = app.state
    await wire(app)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as client:
        yield app, client, st.redis
    st.predictor.close()
    await st.redis.aclose()


async def wire(app) -> None:
    """Set up ``app.state`` as the lifespan would, on fakeredis (in the running event loop), with
    one live instance registered."""
    st = app.state
    st.redis = aioredis.FakeRedis(decode_responses=True)
    st.pool = PoolView(st.settings, st.redis)
    st.db = get_db_engine(st.settings.database_url)
    info = InstanceInfo("i0", st.settings.pool, st.settings.model, THETA, DELTA)
    await st.redis.hset(bus.INSTANCES, "i0", json.dumps(info.to_dict()))
    await st.redis.set(bus.alive_key("i0"), "1")


def leaves_after(seconds: float):
    """A ``request.is_disconnected`` stand-in: the client goes away ``seconds`` from now."""
    gone_at = time.monotonic() + seconds

    async def disconnected() -> bool:
        return time.monotonic() > gone_at

    return disconnected


async def register(redis, name: str, pool: str, model: str, served: str = "", alive: bool = True,
                   theta: int = THETA, max_model_len: int = 0) -> None:
    """An instance of ``pool`` as a worker registers it (heart-beating unless ``alive`` is False)."""
    info = InstanceInfo(name, pool, model, theta, DELTA, served_model_name=served, started=time.time(),
                        max_model_len=max_model_len)
    await redis.hset(bus.INSTANCES, name, json.dumps(info.to_dict()))
    if alive:
        await redis.set(bus.alive_key(name), "1")


async def next_request(redis, timeout_s: float = 10.0, pool: str = "default") -> ProfiledRequest:
    """The next request the gateway enqueued (what the batcher would receive)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        js = await redis.rpop(bus.pool_keys(pool).incoming)
        if js:
            return ProfiledRequest.from_dict(json.loads(js))
        await asyncio.sleep(0.01)
    raise TimeoutError("no request was enqueued")


async def publish(redis, request_id: str, event: StreamEvent) -> None:
    """As a worker publishes: a delta's new tokens are counted as generated in the same pipeline."""
    pipe = redis.pipeline()
    bus.publish(pipe, request_id, event)
    if event.kind is StreamKind.DELTA:
        engine_counters.count_generated(pipe, len(event.ids))
    await pipe.execute()


def end(text: str, tokens: int, reason: FinishReason = FinishReason.STOP) -> StreamEvent:
    return StreamEvent(StreamKind.END, text=text, tokens=tokens, finish_reason=reason.value, batch_id="b-1",
                       batch_size=3, timings={"queued_s": 0.25, "first_token_s": 0.3, "run_s": 0.5,
                                              "total_s": 0.75})


async def worker(redis, pieces: Sequence[str], final: StreamEvent | None = None, gap_s: float = 0.01,
                 reason: FinishReason = FinishReason.STOP, pool: str = "default",
                 logprobs: Sequence[list] | None = None) -> ProfiledRequest:
    """Answer the next request: one delta per piece (token id 100 + i, with ``logprobs[i]`` when
    given), then ``final`` (default: the end event of the concatenated pieces)."""
    req = await next_request(redis, pool=pool)
    for i, piece in enumerate(pieces, 1):
        await asyncio.sleep(gap_s)
        scored = [logprobs[i - 1]] if logprobs is not None else None
        await publish(redis, req.id, StreamEvent.delta(piece, i, [100 + i], scored))
    await asyncio.sleep(gap_s)
    await publish(redis, req.id, final or end("".join(pieces), len(pieces), reason))
    return req


def sse_data(body: str) -> list[dict | str]:
    """The data payloads of an SSE body, JSON-decoded (``[DONE]`` kept as the string)."""
    out: list[dict | str] = []
    for block in body.split("\n\n"):
        if block.startswith("data: "):
            data = block.removeprefix("data: ")
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


@asynccontextmanager
async def answering(redis, pool: str = "default", text: str = "ok"):
    """A worker that answers every request the gateway enqueues, at once, while the block runs.
    Stopped by a flag, not by cancelling: the Redis client may absorb a CancelledError."""
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            got = await redis.brpop([bus.pool_keys(pool).incoming], timeout=0.05)  # wakes on a push
            if got is None:
                continue
            req = ProfiledRequest.from_dict(json.loads(got[1]))
            await publish(redis, req.id, StreamEvent.delta(text, 1, [100]))
            await publish(redis, req.id, end(text, 1))

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        stop.set()
        await task
