"""The clocked step loop of the simulated vLLM engine, and the clock both engines share.

Each step: the scheduler chooses the rows (``scheduler.Scheduler.schedule``), the step-time model
says how long they take, the loop sleeps that long (divided by ``--speedup``), then the step's
tokens go out to their streams, all stamped with the step's end. So a token arrives when the
modelled GPU would have produced it, and every request in a step sees the same step boundaries.

Time is kept in *model* seconds. Steps are laid end to end on deadlines (the next step starts
where the last ended, not when the loop got round to it), so the event loop's wake-up jitter does
not add up; only a loop more than ``LAG_SLACK_S`` wall seconds late (a speedup beyond what one
core does) falls behind, and then the model clock follows the wall clock (``lag_steps`` counts it).

**The front end** (a fit's ``f + g · prompt_tokens``, ``step_time``): the work a server does on a
request before its engine sees it, on the engine's own core (vLLM's CPU build). A request that
arrives while a step runs lengthens that step by its front-end time and joins the waiting queue
when the step ends (the core did both, interleaved); one that arrives while no step runs keeps the
core busy for that long (after any front-end work before it) and joins then, and the next step
waits for it. With no front end (the roofline, or a fit without ``f`` and ``g``) a request joins
the waiting queue at once, as before.
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
from bench.engine_sim.request import SimRequest, Status, Stream
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
        self.front_s = 0.0         # model seconds of front-end work
        self._front: list[tuple[float, SimRequest]] = []   # (done at, request): front end outside a step
        self._front_free = 0.0     # when the front-end work queued outside steps is done
        self._after_step: list[SimRequest] = []            # front end charged to the step in flight
        self._in_step = False
        self._step_end = 0.0
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    # --- the server's side -------------------------------------------------------------------
    def full(self) -> bool:
        queued = len(self.sched.waiting) + len(self._front) + len(self._after_step)
        return bool(self.max_waiting) and queued >= self.max_waiting

    def submit(self, req: SimRequest) -> AsyncIterator[tuple[list[int], str | None]]:
        """Queue a request (after its front end, module docstring); iterate the result for its
        tokens as they are produced."""
        req.arrival = self.clock.now()
        req.stream = Stream()
        cost = self.step_time.front_seconds(req.num_prompt_tokens)
        self.front_s += max(cost, 0.0)
        if cost <= 0.0:
            self.sched.add_request(req)
        elif self._in_step:
            self._step_end += cost
            self._after_step.append(req)
        else:
            self._front_free = max(self._front_free, req.arrival) + cost
            self._front.append((self._front_free, req))
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
        front = [e for e in self._front if e[1] is not req]
        after = [r for r in self._after_step if r is not req]
        if len(front) < len(self._front) or len(after) < len(self._after_step):
            self._front, self._after_step = front, after   # its front-end time stays spent
            req.status = Status.ABORTED
        else:
            self.sched.abort(req)
        if self.metrics is not None:
            self.metrics.aborted += 1
        self._wake.set()

    def gauges(self) -> dict[str, float]:
        st = self.kv.stats
        return {"running": len(self.sched.running), "waiting": len(self.sched.waiting),
                "kv_usage": self.kv.usage, "prefix_queries": st.queries, "prefix_hits": st.hits,
                "preemptions": self.sched.num_preemptions, "steps": self.steps, "lag_steps": self.lag_steps}

    def describe(self) -> dict[str, Any]:
        return {"mode": "engine", "step_time": self.step_time.describe(), "steps": self.steps,
                "busy_model_s": self.busy_s, "front_model_s": self.front_s, "lag_steps": self.lag_steps}

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
            if self._front:                  # the core finishes the front-end work first
                done = self._front[-1][0]
                await self.clock.sleep_until(done)
                ready = [req for at, req in self._front if at <= done]   # not what arrived meanwhile
                self._front = self._front[len(ready):]
                for req in ready:
                    self.sched.add_request(req)
                t = max(t, done)
                continue
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
            self.busy_s += dur
            t = await self._sleep_step(start + dur)
            self.steps += 1
            self._emit(self.sched.update(plan), t)
            for req in self._after_step:     # their front end ran during the step
                self.sched.add_request(req)
            self._after_step.clear()

    async def _sleep_step(self, end: float) -> float:
        """Sleep until the step ends, its end pushed back by the front-end work of every request
        that arrives meanwhile; the end."""
        self._in_step, self._step_end = True, end
        try:
            while True:
                await self.clock.sleep_until(end)
                if self._step_end == end:
                    return end
                end = self._step_end
        finally:
            self._in_step = False

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
