"""The clocked step loop of the simulated vLLM engine, and the clock both engines share.

Each step: the scheduler chooses the rows (``scheduler.Scheduler.schedule``), the step-time model
says how long they take, the loop sleeps that long (divided by ``--speedup``), then the step's
tokens go out to their streams, all stamped with the step's end. So a token arrives when the
modelled GPU would have produced it, and every request in a step sees the same step boundaries.

Time is kept in *model* seconds. Steps are laid end to end on deadlines (the next step starts
where the last ended, not when the loop got round to it), so the event loop's wake-up jitter does
not add up; only a loop more than ``LAG_SLACK_S`` wall seconds late (a speedup beyond what one
core does) falls behind, and then the model clock follows the wall clock (``lag_steps`` counts it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from bench.engine_sim.faults import Faults
from bench.engine_sim.kv_blocks import KVCacheManager
from bench.engine_sim.metrics import SimMetrics
from bench.engine_sim.request import SimRequest, Stream
from bench.engine_sim.scheduler import Scheduler, TokenOut
from bench.engine_sim.step_time import StepShape, StepTime

log = logging.getLogger(__name__)
LAG_SLACK_S = 0.02   # wall seconds a step may start late and still keep the model schedule


class SimClock:
    """Model seconds since start: wall seconds × speedup."""

    def __init__(self, speedup: float = 1.0) -> None:
        if speedup <= 0:
            raise ValueError(f"--speedup must be positive, got {speedup}")
        self.speedup = speedup
        self._t0 = time.monotonic()

    def now(self) -> float:
        return (time.monotonic() - self._t0) * self.speedup

    async def sleep_until(self, model_t: float) -> None:
        """Sleep until the wall time of ``model_t``; yield to the loop even when it has passed, so
        the handlers write each step's tokens before the next step runs."""
        left = model_t / self.speedup - (time.monotonic() - self._t0)
        await asyncio.sleep(max(left, 0.0))

    async def sleep(self, model_s: float) -> None:
        await asyncio.sleep(model_s / self.speedup)


class SteppedEngine:
    """The vLLM-v1-shaped engine: one scheduler, one KV manager, one step loop task."""

    def __init__(self, scheduler: Scheduler, step_time: StepTime, clock: SimClock, faults: Faults,
                 max_waiting: int = 0) -> None:
        self.sched = scheduler
        self.kv: KVCacheManager = scheduler.kv
        self.step_time = step_time
        self.clock = clock
        self.faults = faults
        self.max_waiting = max_waiting
        self.metrics: SimMetrics | None = None
        self.steps = 0
        self.busy_s = 0.0          # model seconds spent in steps
        self.lag_steps = 0         # steps that started late because the loop could not keep up
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # --- the server's side -------------------------------------------------------------------
    def full(self) -> bool:
        return bool(self.max_waiting) and len(self.sched.waiting) >= self.max_waiting

    def submit(self, req: SimRequest) -> AsyncIterator[tuple[list[int], str | None]]:
        """Queue a request; iterate the result for its tokens as they are produced."""
        req.arrival = self.clock.now()
        req.stream = Stream()
        self.sched.add_request(req)
        self._wake.set()
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self.run())
        return self._tokens(req)

    async def _tokens(self, req: SimRequest) -> AsyncIterator[tuple[list[int], str | None]]:
        stream = req.stream
        assert stream is not None
        while True:
            ids, finish = await stream.take()
            yield ids, finish
            if finish is not None:
                return

    def abort(self, req: SimRequest) -> None:
        self.sched.abort(req)
        if self.metrics is not None:
            self.metrics.aborted += 1
        self._wake.set()

    def gauges(self) -> dict[str, float]:
        st = self.kv.stats
        return {"running": len(self.sched.running), "waiting": len(self.sched.waiting),
                "kv_usage": self.kv.usage, "prefix_queries": st.queries, "prefix_hits": st.hits,
                "preemptions": self.sched.num_preemptions}

    def describe(self) -> dict[str, Any]:
        return {"mode": "engine", "step_time": self.step_time.describe(), "steps": self.steps,
                "busy_model_s": self.busy_s, "lag_steps": self.lag_steps}

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # --- the loop ------------------------------------------------------------------------------
    async def run(self) -> None:
        t = self.clock.now()
        while True:
            if not self.sched.has_work():
                self._wake.clear()
                await self._wake.wait()
                t = self.clock.now()
                continue
            await self.faults.wait_stall()
            now = self.clock.now()
            start = t
            if now > t + LAG_SLACK_S * self.clock.speedup:   # the loop fell behind: follow the wall clock
                self.lag_steps += 1
                start = now
            plan = self.sched.schedule()
            if not plan.rows:                # nothing can run until something changes
                self._wake.clear()
                await self._wake.wait()
                continue
            dur = self.step_time.seconds(StepShape.of(plan))
            t = start + dur
            self.busy_s += dur
            await self.clock.sleep_until(t)
            self.steps += 1
            self._emit(self.sched.update(plan), t)

    def _emit(self, outs: list[TokenOut], t: float) -> None:
        m = self.metrics
        for o in outs:
            req = o.req
            if m is not None:
                if req.first_token_at is None:
                    m.ttft.observe(t - req.arrival)
                else:
                    m.itl.observe(t - (req.last_token_at or t))
                if o.finish is not None:
                    m.request_done(req.num_prompt_tokens, req.num_output_tokens, t - req.arrival)
            if req.first_token_at is None:
                req.first_token_at = t
            req.last_token_at = t
            if req.stream is not None:
                req.stream.push(o.token_id, o.finish)
