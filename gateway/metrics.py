"""Prometheus metrics. Queue, in-flight and instance gauges are read from Redis at scrape time,
so the one /metrics endpoint shows the batcher's and workers' side too."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from cohort import bus


class GatewayMetrics:
    """One registry per app (tests build several apps in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("cohort_requests_total", "Requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.latency = Histogram("cohort_request_latency_seconds", "End-to-end latency of answered requests",
                                 ["endpoint"], registry=r,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        self.predicted_tokens = Histogram("cohort_predicted_tokens", "Predicted generation length",
                                          registry=r, buckets=(8, 16, 32, 64, 128, 256, 512, 1024, 2048))
        self.generated_tokens = Counter("cohort_generated_tokens_total", "Tokens generated", registry=r)
        self.pending = Gauge("cohort_queue_pending_requests", "Requests waiting to be batched", registry=r)
        self.inflight = Gauge("cohort_inflight_batches", "Batches dispatched and not finished", registry=r)
        self.instances = Gauge("cohort_instances_alive", "LLM instances of this pool heart-beating", registry=r)
        self.counters = Gauge("cohort_batcher_events", "Batcher counters (batches, OOM splits, requeues, failures)",
                              ["event"], registry=r)

    async def render(self, redis, alive_instances: int) -> bytes:
        self.pending.set(await redis.llen(bus.INCOMING) + await redis.hlen(bus.PENDING))
        self.inflight.set(await redis.hlen(bus.INFLIGHT))
        self.instances.set(alive_instances)
        for k, v in (await redis.hgetall(bus.STATS)).items():
            self.counters.labels(event=k).set(float(v))
        return generate_latest(self.registry)
