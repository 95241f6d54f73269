"""Prometheus metrics. Queue, in-flight and instance gauges are read from Redis at scrape time,
so the one /metrics endpoint shows the batcher's and workers' side too.

Token latencies are named after vLLM's (``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``request_queue_time_seconds``, ``e2e_request_latency_seconds``)
so dashboards built for it read ours. TTFT, inter-token and end-to-end latency are measured at the
gateway, from the HTTP request's arrival, as the client sees them; queue time is the worker's
(the end event's ``timings.queued_s``).
"""

from __future__ import annotations

import json
import logging
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from sqlalchemy import and_, case, func, select
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cohort import bus, engine_counters
from cohort.logdb import requests as request_rows
from cohort.types import InstanceInfo
from gateway.metrics_processes import exposition

log = logging.getLogger("cohort.gateway")

# The generation routes and their ``endpoint`` label.
ENDPOINTS = {"/v1/generate": "generate", "/v1/completions": "completions", "/v1/chat/completions": "chat"}

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600)
_TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1, 2.5,
                  5, 10)


class GatewayMetrics:
    """One registry per app (tests build several apps in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cohort_requests_total", "Generation requests by endpoint and HTTP status sent "
                                "(a stream that fails after its headers counts as 200; see failures)",
                                ["endpoint", "status"], registry=r)
        # Per request (one HTTP request, whatever its n): the vLLM names. Per choice: cohort_choice_*.
        self.latency = Histogram("cohort_e2e_request_latency_seconds",
                                 "Answered requests, one observation per HTTP request: arrival to its last choice's "
                                 "end", ["endpoint"], registry=r, buckets=_LATENCY_BUCKETS)
        self.ttft = Histogram("cohort_time_to_first_token_seconds",
                              "One observation per HTTP request: arrival to the first token's text of any of its "
                              "choices", ["endpoint"], registry=r, buckets=_LATENCY_BUCKETS)
        self.choice_latency = Histogram("cohort_choice_e2e_latency_seconds",
                                        "Answered choices, one observation per choice (n of them for n > 1): HTTP "
                                        "arrival to the choice's end", ["endpoint"], registry=r,
                                        buckets=_LATENCY_BUCKETS)
        self.choice_ttft = Histogram("cohort_choice_time_to_first_token_seconds",
                                     "One observation per choice: HTTP arrival to the choice's first token's text",
                                     ["endpoint"], registry=r, buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("cohort_inter_token_latency_seconds",
                             "Time between successive tokens of one choice at the gateway (a delta carrying k "
                             "tokens counts as one observation of gap/k)", ["endpoint"], registry=r,
                             buckets=_TOKEN_BUCKETS)
        self.queue_time = Histogram("cohort_request_queue_time_seconds",
                                    "One observation per answered HTTP request: arrival to the start of the first "
                                    "batch that ran one of its choices (worker-measured)",
                                    ["endpoint"], registry=r, buckets=_LATENCY_BUCKETS)
        self.cancelled = Counter("cohort_requests_cancelled_total",
                                 "HTTP requests withdrawn before their answer: client disconnect or gateway timeout",
                                 ["endpoint", "reason"], registry=r)
        self.choices_cancelled = Counter("cohort_choices_cancelled_total",
                                         "Choices withdrawn before their answer (n per request for n > 1)",
                                         ["endpoint", "reason"], registry=r)
        self.failures = Counter("cohort_request_failures_total",
                                "Choices that failed after admission, by failure code (one per failed choice)",
                                ["endpoint", "code"], registry=r)
        self.predicted_tokens = Histogram("cohort_predicted_tokens", "Predicted generation length",
                                          registry=r, buckets=(8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.generated_tokens = RedisCounter("cohort_generated_tokens", "Tokens the workers generated, counted "
                                             "as they are generated (also for requests later cancelled, failed "
                                             "or preempted)")
        r.register(self.generated_tokens)
        self.prefix_queries = RedisCounter("cohort_prefix_cache_queries", "Prompt tokens looked up in an "
                                           "instance's prefix cache (vLLM's vllm:prefix_cache_queries)", "instance")
        self.prefix_hits = RedisCounter("cohort_prefix_cache_hits", "Of those prompt tokens, the ones whose KV "
                                        "the instance's prefix cache had", "instance")
        r.register(self.prefix_queries)
        r.register(self.prefix_hits)
        self.pending = Gauge("cohort_queue_pending_requests", "Requests waiting to be batched", registry=r)
        self.inflight = Gauge("cohort_inflight_batches", "Batches dispatched and not finished", registry=r)
        self.instances = Gauge("cohort_instances_alive", "LLM instances of this pool heart-beating", registry=r)
        self.counters = Gauge("cohort_batcher_events", "Batcher counters (batches, OOM splits, requeues, failures)",
                              ["event"], registry=r)
        self.pools = PoolGauges(r)
        self.recent = RecentOutcomes(r)

    async def render(self, redis, alive_instances: int, pool: str) -> bytes:
        keys = bus.pool_keys(pool)
        self.pending.set(await redis.llen(keys.incoming) + await redis.hlen(keys.pending))
        self.inflight.set(await redis.hlen(keys.inflight))
        self.instances.set(alive_instances)
        self.prefix_queries.values = {k: float(v) for k, v in (await redis.hgetall(engine_counters.PREFIX_QUERIES)).items()}
        self.prefix_hits.values = {k: float(v) for k, v in (await redis.hgetall(engine_counters.PREFIX_HITS)).items()}
        for k, v in (await redis.hgetall(bus.STATS)).items():
            if k == bus.GENERATED_TOKENS:
                self.generated_tokens.value = float(v)
            else:
                self.counters.labels(event=k).set(float(v))
        await self.pools.fill(redis, pool)
        return exposition(self.registry)


# Σ of a JSON field over a hash's values and a list's items, inside Redis (the waiting requests are
# not copied to the gateway at every scrape). KEYS: hash, list; ARGV: field, fallback field.
_SUM_FIELD_LUA = """
local total = 0
local function add(js)
  local ok, r = pcall(cjson.decode, js)
  if ok and type(r) == 'table' then
    local v = r[ARGV[1]]
    if type(v) ~= 'number' then v = r[ARGV[2]] end
    if type(v) == 'number' then total = total + v end
  end
end
for _, js in ipairs(redis.call('HVALS', KEYS[1])) do add(js) end
for _, js in ipairs(redis.call('LRANGE', KEYS[2], 0, -1)) do add(js) end
return tostring(total)
"""

# Σ over the in-flight batches of their rows' planned KV: prompt + upper predicted length (else the
# point prediction). KEYS: the pool's inflight hash.
_INFLIGHT_KV_LUA = """
local total = 0
for _, js in ipairs(redis.call('HVALS', KEYS[1])) do
  local ok, d = pcall(cjson.decode, js)
  if ok and type(d) == 'table' and type(d.batch) == 'table' and type(d.batch.requests) == 'table' then
    for _, r in ipairs(d.batch.requests) do
      local gen = r.predicted_upper
      if type(gen) ~= 'number' then gen = r.predicted_tokens end
      total = total + (tonumber(r.input_tokens) or 0) + (tonumber(gen) or 0)
    end
  end
end
return tostring(total)
"""


class PoolGauges:
    """Per pool, for autoscalers and alerts (every pool with a registered instance, plus the
    gateway's own and every pool seen since the gateway started, so a pool whose last instance
    went away reads 0 instead of vanishing): the requests waiting and the tokens they are predicted
    to generate, the live instances by kind, and the KV the in-flight batches planned against the
    pool's KV capacity; per instance, whether it heart-beats and its engine's running rows."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.queue = Gauge("cohort_pool_queue_requests", "Requests waiting in the pool's queue (arrived, reserved or "
                           "waiting in the batcher, not yet dispatched)", ["pool"], registry=r)
        self.queue_tokens = Gauge("cohort_pool_queue_predicted_tokens", "Σ predicted generation length of the "
                                  "pool's waiting requests: the work waiting, in tokens", ["pool"], registry=r)
        self.queue_prompt_tokens = Gauge("cohort_pool_queue_prompt_tokens", "Σ prompt tokens of the pool's waiting "
                                         "requests (what their prefill costs)", ["pool"], registry=r)
        self.live = Gauge("cohort_pool_instances_live", "Heart-beating instances of the pool by kind "
                          "(builtin: a cohort engine, upstream: an OpenAI-compatible server cohort feeds)",
                          ["pool", "kind"], registry=r)
        self.kv_planned = Gauge("cohort_pool_kv_planned_tokens", "KV tokens the pool's in-flight batches planned: "
                                "Σ prompt + upper predicted length of their rows", ["pool"], registry=r)
        self.kv_capacity = Gauge("cohort_pool_kv_capacity_tokens", "KV tokens the pool's live instances hold "
                                 "(Σ Θ/Δ)", ["pool"], registry=r)
        self.kv_usage = Gauge("cohort_pool_kv_usage_ratio", "cohort_pool_kv_planned_tokens / "
                              "cohort_pool_kv_capacity_tokens (0 without a live instance)", ["pool"], registry=r)
        self.instance_up = Gauge("cohort_instance_up", "1 while a registered instance heart-beats, 0 once its "
                                 "heartbeat expired (until the batcher drops its registration)",
                                 ["instance", "pool", "kind"], registry=r)
        self.engine_rows = Gauge("cohort_engine_running_rows", "Rows resident in a built-in instance's engine",
                                 ["instance"], registry=r)
        self.engine_waiting = Gauge("cohort_engine_waiting_groups", "Admission groups a built-in instance holds "
                                    "that have not joined its running rows yet", ["instance"], registry=r)
        self.seen_pools: set[str] = set()

    async def fill(self, redis, own_pool: str) -> None:
        infos = [InstanceInfo.from_dict(json.loads(js)) for js in (await redis.hgetall(bus.INSTANCES)).values()]
        pipe = redis.pipeline(transaction=False)
        for info in infos:
            pipe.exists(bus.alive_key(info.name))
        beating = await pipe.execute() if infos else []
        self.seen_pools |= {own_pool, *(i.pool for i in infos)}
        sum_field = redis.register_script(_SUM_FIELD_LUA)
        inflight_kv = redis.register_script(_INFLIGHT_KV_LUA)
        for g in (self.instance_up, self.engine_rows, self.engine_waiting):
            g.clear()  # instances come and go: only the registered ones are series
        for info, hit in zip(infos, beating, strict=True):
            self.instance_up.labels(info.name, info.pool, _kind(info)).set(1 if hit else 0)
        for pool in sorted(self.seen_pools):
            k = bus.pool_keys(pool)
            pipe = redis.pipeline(transaction=False)
            pipe.llen(k.incoming)
            pipe.hlen(k.pending)
            pipe.zcount(k.reservations, time.time(), "+inf")
            depth = sum(int(x) for x in await pipe.execute())
            self.queue.labels(pool).set(depth)
            self.queue_tokens.labels(pool).set(float(await sum_field(keys=[k.pending, k.incoming],
                                                                     args=["predicted_tokens", "max_tokens"])))
            self.queue_prompt_tokens.labels(pool).set(float(await sum_field(keys=[k.pending, k.incoming],
                                                                            args=["input_tokens", "input_tokens"])))
            live = [i for i, hit in zip(infos, beating, strict=True) if hit and i.pool == pool]
            for kind in ("builtin", "upstream"):
                self.live.labels(pool, kind).set(sum(1 for i in live if _kind(i) == kind))
            capacity = sum(i.theta_bytes // i.delta_bytes for i in live if i.delta_bytes > 0)
            planned = float(await inflight_kv(keys=[k.inflight]))
            self.kv_planned.labels(pool).set(planned)
            self.kv_capacity.labels(pool).set(capacity)
            self.kv_usage.labels(pool).set(planned / capacity if capacity else 0.0)
        for name, js in (await redis.hgetall(engine_counters.ENGINE_STATS)).items():
            if not any(i.name == name for i in infos):
                continue  # a stopped instance's last totals stay in the hash
            try:
                c = json.loads(js)
            except ValueError:
                continue
            self.engine_rows.labels(name).set(float(c.get("rows", 0)))
            self.engine_waiting.labels(name).set(float(c.get("waiting_groups", 0)))


def _kind(info: InstanceInfo) -> str:
    return "upstream" if info.upstream else "builtin"


RECENT_WINDOW_S = 300.0  # the window of RecentOutcomes' gauges


class RecentOutcomes:
    """Read from the log DB at scrape time, per served model, over the requests that ended in the last
    ``RECENT_WINDOW_S`` seconds: how many had an SLO and how many of those were answered within it
    (SLO attainment; a request that failed or timed out missed it, a cancelled one is left out),
    and how many a model planned with an upper bound and how many of those stayed within it (the
    predictor's q90 coverage, ``cohort predictor coverage``'s rule). The log DB is the gateway's
    (``app.state.db``), found on the first request the gateway serves (``CountRequests``)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.state = None
        registry.register(self)

    def collect(self):
        db = getattr(self.state, "db", None)
        if db is None:
            return
        window = GaugeMetricFamily("cohort_recent_window_seconds", "The window of the cohort_recent_* gauges",
                                   value=RECENT_WINDOW_S)
        slo_n = GaugeMetricFamily("cohort_recent_slo_requests", "Requests with an SLO that ended in the window "
                                  "(answered, failed or timed out)", labels=["model"])
        slo_met = GaugeMetricFamily("cohort_recent_slo_met_requests", "Of those, the ones answered within their "
                                    "SLO (total_s <= slo_s)", labels=["model"])
        cov_n = GaugeMetricFamily("cohort_recent_planned_requests", "Answered requests in the window that a "
                                  "length model planned with an upper bound", labels=["model"])
        cov_in = GaugeMetricFamily("cohort_recent_covered_requests", "Of those, the ones whose actual length "
                                   "stayed within the bound (q90 coverage = covered / planned)", labels=["model"])
        t = request_rows.c
        since = time.time() - RECENT_WINDOW_S
        met = and_(t.status == "done", t.total_s <= t.slo_s)
        planned = and_(t.status == "done", t.predicted_upper.is_not(None), t.actual_tokens.is_not(None),
                       t.predictor_version.is_not(None),
                       (t.max_tokens.is_(None)) | (t.predicted_tokens < t.max_tokens))
        try:
            with db.connect() as conn:
                for model, n, m in conn.execute(
                        select(t.model, func.count(), func.sum(case((met, 1), else_=0)))
                        .where(t.finished > since, t.slo_s.is_not(None), t.status != "cancelled")
                        .group_by(t.model)):
                    slo_n.add_metric([model or ""], n)
                    slo_met.add_metric([model or ""], m or 0)
                for model, n, c in conn.execute(
                        select(t.model, func.count(), func.sum(case((t.actual_tokens <= t.predicted_upper, 1),
                                                                    else_=0)))
                        .where(t.finished > since, planned).group_by(t.model)):
                    cov_n.add_metric([model or ""], n)
                    cov_in.add_metric([model or ""], c or 0)
        except Exception:  # the log DB away for a moment: the rest of /metrics still answers
            log.warning("recent outcome metrics unavailable", exc_info=True)
            return
        yield from (window, slo_n, slo_met, cov_n, cov_in)


class RedisCounter:
    """A counter whose truth lives in Redis (the workers increment it: ``engine_counters.count_generated``),
    exported as a Prometheus counter with the value read at the latest scrape."""

    def __init__(self, name: str, documentation: str, label: str | None = None) -> None:
        self.name, self.documentation, self.value = name, documentation, 0.0
        self.label = label
        self.values: dict[str, float] = {}   # with ``label``: one series per label value

    def collect(self):
        if self.label is None:
            yield CounterMetricFamily(self.name, self.documentation, value=self.value)
            return
        family = CounterMetricFamily(self.name, self.documentation, labels=[self.label])
        for key, v in sorted(self.values.items()):
            family.add_metric([key], v)
        yield family


class CountRequests:
    """ASGI middleware: counts every generation request by the HTTP status it was sent with.

    A middleware rather than a count in each view, because validation errors (400) are answered
    before a view runs, and so every status is counted in one place."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.metrics.recent.state is None and "app" in scope:
            self.metrics.recent.state = scope["app"].state  # the log DB of RecentOutcomes
        endpoint = ENDPOINTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return

        started = False

        async def counting_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.metrics.requests.labels(endpoint, str(message["status"])).inc()
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        except Exception:  # answered 500 by the outermost handler, outside this middleware
            if not started:
                self.metrics.requests.labels(endpoint, "500").inc()
            raise
