"""Prometheus metrics. Queue, in-flight and instance gauges are read from Redis at scrape time,
so the one /metrics endpoint shows the batcher's and workers' side too.

Token latencies are named after vLLM's (``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``request_queue_time_seconds``, ``e2e_request_latency_seconds``)
so dashboards built for it read ours. TTFT, inter-token and end-to-end latency are measured at the
gateway, from the HTTP request's arrival, as the client sees them; queue time is the worker's
(the end event's ``timings.queued_s``).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from cohort import bus

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

    async def render(self, redis, alive_instances: int, pool: str) -> bytes:
        keys = bus.pool_keys(pool)
        self.pending.set(await redis.llen(keys.incoming) + await redis.hlen(keys.pending))
        self.inflight.set(await redis.hlen(keys.inflight))
        self.instances.set(alive_instances)
        self.prefix_queries.values = {k: float(v) for k, v in (await redis.hgetall(bus.PREFIX_QUERIES)).items()}
        self.prefix_hits.values = {k: float(v) for k, v in (await redis.hgetall(bus.PREFIX_HITS)).items()}
        for k, v in (await redis.hgetall(bus.STATS)).items():
            if k == bus.GENERATED_TOKENS:
                self.generated_tokens.value = float(v)
            else:
                self.counters.labels(event=k).set(float(v))
        return generate_latest(self.registry)


class RedisCounter:
    """A counter whose truth lives in Redis (the workers increment it: ``bus.count_generated``),
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
