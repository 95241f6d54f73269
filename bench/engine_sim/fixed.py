"""The fixed-delay engine (``--ttft-ms T --itl-ms I``): no queue, no KV, no batching; every request
on its own gets its first token T ms after it arrives and one more every I ms.

It exists to measure a front (cohort's gateway and worker) against a zero-compute engine that
shares the front's cores, so its own CPU per request must be small: a request is one async
generator that sleeps on deadlines and hands out token ids drawn from the precomputed output
vocabulary; the handler writes pre-assembled bytes (``wire``). Nothing per token allocates more
than the chunk itself.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from bench.engine_sim.engine import SimClock
from bench.engine_sim.faults import Faults
from bench.engine_sim.metrics import SimMetrics
from bench.engine_sim.request import SimRequest, Status


class FixedDelayEngine:
    def __init__(self, ttft_ms: float, itl_ms: float, clock: SimClock, faults: Faults, max_waiting: int = 0) -> None:
        if ttft_ms < 0 or itl_ms < 0:
            raise ValueError("--ttft-ms and --itl-ms must be non-negative")
        self.ttft_s = ttft_ms / 1000.0
        self.itl_s = itl_ms / 1000.0
        self.clock = clock
        self.faults = faults
        self.max_waiting = max_waiting   # no queue here: it bounds the requests in flight
        self.metrics: SimMetrics | None = None
        self.in_flight = 0

    def full(self) -> bool:
        return bool(self.max_waiting) and self.in_flight >= self.max_waiting

    def submit(self, req: SimRequest) -> AsyncIterator[tuple[list[int], str | None]]:
        req.arrival = self.clock.now()
        req.status = Status.RUNNING
        req.num_cached_tokens = 0
        return self._tokens(req)

    async def _tokens(self, req: SimRequest) -> AsyncIterator[tuple[list[int], str | None]]:
        self.in_flight += 1
        speed = self.clock.speedup
        m = self.metrics
        t0 = time.monotonic()
        due = t0 + self.ttft_s / speed
        gap = self.itl_s / speed
        n = req.max_tokens
        try:
            for i in range(n):
                left = due - time.monotonic()
                if left > 0:
                    await asyncio.sleep(left)
                if self.faults.stall_until:
                    await self.faults.wait_stall()
                tid = req.draw()
                req.output_ids.append(tid)
                finish = "length" if i == n - 1 else None
                if m is not None:
                    if i == 0:
                        m.ttft.observe(self.ttft_s)
                    else:
                        m.itl.observe(self.itl_s)
                    if finish is not None:
                        m.request_done(req.num_prompt_tokens, n, (time.monotonic() - t0) * speed)
                due += gap
                yield [tid], finish
            req.status = Status.FINISHED
            req.finish_reason = "length"
        finally:
            self.in_flight -= 1

    def abort(self, req: SimRequest) -> None:
        req.status = Status.ABORTED
        if self.metrics is not None:
            self.metrics.aborted += 1

    def gauges(self) -> dict[str, float]:
        return {"running": self.in_flight, "waiting": 0, "kv_usage": 0.0}

    def describe(self) -> dict[str, Any]:
        return {"mode": "fixed-delay", "ttft_ms": self.ttft_s * 1000, "itl_ms": self.itl_s * 1000}

    async def stop(self) -> None:
        return None
