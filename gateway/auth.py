"""API keys on /v1: who is calling, whether they may, and what they used.

``ApiKeys`` is ASGI middleware in front of every ``/v1/…`` route. With no key configured
(``COHORT_API_KEYS``) or created (``/admin/keys``) the API is open, as before. Once any exists (or ever existed: revoking the last one does not open it):

- a missing, unknown or revoked key is answered 401 with OpenAI's error body (code ``invalid_api_key``);
- a key over its requests-per-minute, or whose tokens this minute are spent, is answered 429 with
  ``Retry-After`` (the seconds until the minute turns). The counters are Redis keys per key and
  minute, so every gateway process shares them;
- the key's id goes to ``request.state.api_key_id``: files and batches belong to it (gateway.owner);
- tokens used (the answer's ``usage``) and requests are added to the key's totals in the log DB
  (``key_usage``) and to ``cohort_api_key_*_total`` on /metrics.

The job runner calls with its own secret (cohort.apikeys.runner_secret) and names the job's key
in ``X-Cohort-Batch-Owner``: its rows count as that key's usage but are not held to the per-minute
limits (a batch's rows are paced by the runner, and must not starve the key's interactive calls).
Streamed answers count too: their usage chunk is optional, so the SSE body reports its tokens
through ``stream_usage`` (a tally this middleware keeps for the request's context).
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass

from fastapi.responses import JSONResponse
from prometheus_client import CollectorRegistry, Counter
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cohort import jobdb
from cohort.apikeys import (
    INTERACTIVE_SEEN_KEY,
    ROW_REQUEST_HEADER,
    RUNNER_HEADER,
    configured_keys,
    env_key_id,
    hash_key,
    runner_secret,
)
from cohort.settings import Settings
from gateway.errors import APIError
from gateway.reattach import name_row_request, reset_row_request

log = logging.getLogger("cohort.gateway.auth")

REFRESH_S = 2.0   # a key created or revoked through another gateway process counts within this
COUNTED = ("/v1/chat/completions", "/v1/completions")  # the routes whose answers carry usage
OPEN = ""         # the owner of everything when no key exists
_STREAM_USAGE: ContextVar[list[int] | None] = ContextVar("cohort_stream_usage", default=None)


def stream_usage(prompt: int, completion: int) -> None:
    """A streamed answer's tokens (gateway.sse calls it at the stream's end), added to the tally
    ``ApiKeys`` keeps for the request: the usage chunk is optional, so the body may not say."""
    tally = _STREAM_USAGE.get()
    if tally is not None:
        tally[0] += prompt
        tally[1] += completion


@dataclass(frozen=True)
class KeyLimits:
    id: str
    rpm: int   # 0: no limit
    tpm: int


class KeyMetrics:
    """Per-key counters on the app's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("cohort_api_key_requests_total", "Requests to /v1 by API key id and HTTP status",
                                ["key", "status"], registry=registry)
        self.tokens = Counter("cohort_api_key_tokens_total", "Tokens answered by API key id (prompt, completion)",
                              ["key", "kind"], registry=registry)
        self.limited = Counter("cohort_api_key_limited_total", "Requests refused with 429 by API key id and limit",
                               ["key", "limit"], registry=registry)


class KeyBook:
    """The valid keys (hash → limits): the configured ones and the log DB's unrevoked ones,
    re-read every ``REFRESH_S``. ``closed``: keys are in use — some are configured, or were ever
    created (revoking the last key does not open the API to everyone)."""

    def __init__(self, s: Settings) -> None:
        self.s = s
        self._env = {hash_key(k): KeyLimits(env_key_id(hash_key(k)), s.api_key_rpm, s.api_key_tpm)
                     for k in configured_keys(s.api_keys)}
        self._keys: dict[str, KeyLimits] = dict(self._env)
        self._read_at = 0.0
        self.closed = bool(self._env)
        self.runner = runner_secret(s.data_dir)

    def refresh(self, db) -> None:
        keys = dict(self._env)
        stored = jobdb.list_keys(db)
        for k in stored:
            if k["revoked"] is None:
                keys[k["hash"]] = KeyLimits(k["id"], self.s.api_key_rpm if k["rpm"] is None else k["rpm"],
                                            self.s.api_key_tpm if k["tpm"] is None else k["tpm"])
        self._keys, self._read_at, self.closed = keys, time.monotonic(), bool(self._env or stored)

    async def current(self, db) -> dict[str, KeyLimits]:
        if time.monotonic() - self._read_at > REFRESH_S:
            await run_in_threadpool(self.refresh, db)
        return self._keys


def _bearer(scope: Scope) -> str | None:
    headers = dict(scope.get("headers") or [])
    scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
    return given.strip() if scheme.lower() == "bearer" and given.strip() else None


def _usage_of(body: bytes) -> tuple[int, int]:
    try:
        u = json.loads(body).get("usage") or {}
        return int(u.get("prompt_tokens") or 0), int(u.get("completion_tokens") or 0)
    except (ValueError, AttributeError, TypeError):
        return 0, 0


class ApiKeys:
    """The middleware (see the module docstring). Needs ``app.state.redis``, ``.db``, ``.keys``
    (a KeyBook) and ``.key_metrics``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self._seen_at = 0.0  # when this process last told the job runner of interactive traffic

    async def _mark_interactive(self, st) -> None:
        """Tell the job runner interactive requests are arriving (at most once a second per process)."""
        now = time.time()
        if now - self._seen_at < 1.0:
            return
        self._seen_at = now
        try:
            await st.redis.set(INTERACTIVE_SEEN_KEY, str(now), ex=3600)
        except Exception:  # a hint for the runner: never worth failing a request over
            log.debug("could not mark interactive traffic", exc_info=True)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        st = scope["app"].state
        book: KeyBook = st.keys
        given = _bearer(scope)
        keys = await book.current(st.db)
        limits: KeyLimits | None = None
        from_runner = given is not None and given == book.runner
        if not from_runner and scope["path"] in COUNTED:
            await self._mark_interactive(st)
        row_request = None
        if from_runner:
            headers = dict(scope.get("headers") or [])
            owner = headers.get(RUNNER_HEADER.encode(), b"").decode("latin-1")
            row_request = headers.get(ROW_REQUEST_HEADER.encode(), b"").decode("latin-1")
        elif not book.closed:
            owner = OPEN
        else:
            limits = keys.get(hash_key(given)) if given else None
            if limits is None:
                msg = ("You didn't provide an API key: send Authorization: Bearer <key>" if given is None
                       else "Incorrect API key provided")
                await self._refuse(scope, receive, send, APIError(401, msg, code="invalid_api_key"))
                return
            owner = limits.id
            if refusal := await self._over_limit(st, limits):
                await self._refuse(scope, receive, send, refusal)
                return
        scope.setdefault("state", {})["api_key_id"] = owner
        named = name_row_request(row_request)  # the runner names its row's request (gateway.reattach)
        try:
            if not owner:
                await self.app(scope, receive, send)
                return
            await self._counted(scope, receive, send, st, owner)
        finally:
            reset_row_request(named)

    async def _over_limit(self, st, k: KeyLimits) -> APIError | None:
        now = time.time()
        minute, wait = int(now // 60), max(1, int(60 - now % 60))
        rkey, tkey = f"cohort:ratelimit:{k.id}:{minute}:r", f"cohort:ratelimit:{k.id}:{minute}:t"
        if k.rpm:
            pipe = st.redis.pipeline()
            pipe.incr(rkey)
            pipe.expire(rkey, 120)
            n, _ = await pipe.execute()
            if int(n) > k.rpm:
                st.key_metrics.limited.labels(k.id, "rpm").inc()
                return _limited(f"Rate limit reached: {k.rpm} requests per minute for this key", wait)
        if k.tpm and int(await st.redis.get(tkey) or 0) >= k.tpm:
            st.key_metrics.limited.labels(k.id, "tpm").inc()
            return _limited(f"Rate limit reached: {k.tpm} tokens per minute for this key", wait)
        return None

    async def _counted(self, scope: Scope, receive: Receive, send: Send, st, owner: str) -> None:
        """Run the request and count it (and its tokens, from a JSON answer's usage) for ``owner``."""
        status, body, is_json = 0, bytearray(), False
        counted = scope["path"] in COUNTED and scope["method"] == "POST"

        async def watch(message: Message) -> None:
            nonlocal status, is_json
            if message["type"] == "http.response.start":
                status = message["status"]
                ctype = dict(message.get("headers") or []).get(b"content-type", b"")
                is_json = ctype.startswith(b"application/json")
            elif message["type"] == "http.response.body" and counted and is_json and status == 200:
                body.extend(message.get("body", b""))
            await send(message)

        tally = [0, 0]  # a streamed answer's tokens (stream_usage)
        reset = _STREAM_USAGE.set(tally)
        try:
            await self.app(scope, receive, watch)
        finally:
            _STREAM_USAGE.reset(reset)
            prompt, completion = _usage_of(bytes(body)) if body else (tally[0], tally[1])
            m = st.key_metrics
            m.requests.labels(owner, str(status)).inc()
            if prompt or completion:
                m.tokens.labels(owner, "prompt").inc(prompt)
                m.tokens.labels(owner, "completion").inc(completion)
                tkey = f"cohort:ratelimit:{owner}:{int(time.time() // 60)}:t"
                try:
                    pipe = st.redis.pipeline()
                    pipe.incrby(tkey, prompt + completion)
                    pipe.expire(tkey, 120)
                    await pipe.execute()
                except Exception:  # the answer was sent: a counter that failed must not fail it
                    log.exception("could not count tokens of key %s", owner)
            try:
                if counted:
                    await run_in_threadpool(jobdb.add_usage, st.db, owner, 1, prompt, completion)
            except Exception:
                log.exception("could not record usage of key %s", owner)

    @staticmethod
    async def _refuse(scope: Scope, receive: Receive, send: Send, e: APIError) -> None:
        rid = (scope.get("state") or {}).get("request_id")
        headers = {**e.headers, **({"Retry-After": e.retry_after} if getattr(e, "retry_after", None) else {})}
        await JSONResponse(e.body(rid), status_code=e.status, headers=headers)(scope, receive, send)


def _limited(message: str, wait_s: int) -> APIError:
    e = APIError(429, message, code="rate_limit_exceeded")
    e.retry_after = str(wait_s)  # type: ignore[attr-defined]
    return e


def owner_of(request) -> str:
    """The key id a /v1 request was made with ("" when the API is open)."""
    return getattr(request.state, "api_key_id", OPEN) or OPEN
