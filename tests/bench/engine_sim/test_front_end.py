"""The front end of a fitted simulator (``f + g · prompt_tokens`` of the engine's core per request):
the stepped engine spends it before a request joins the waiting queue and lengthens the step in
flight by it; the fit finds it from runs of steps and idle first tokens. Deterministic: the
engine runs on a clock the test moves by hand, the fit on samples made from known coefficients."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import pytest

from bench.engine_sim.engine import SteppedEngine
from bench.engine_sim.faults import Faults
from bench.engine_sim.fit_front import FrontSample, fit_front, front_errors, front_samples, robust_front_fit
from bench.engine_sim.fit_upstream import Trace, step_runs_timed
from bench.engine_sim.step_time import FIT_FORM_V2, FittedStepTime, StepShape, load_fit
from tests.bench.engine_sim.helpers import make_req, make_sched


class HandClock:
    """Model time that moves only when the test says: ``sleep_until`` parks the engine's loop
    until ``advance`` moves the clock to where it asked to wake."""

    speedup = 1.0

    def __init__(self) -> None:
        self.t = 0.0
        self.wake_at: float | None = None
        self._fut: asyncio.Future | None = None

    def now(self) -> float:
        return self.t

    async def sleep_until(self, t: float) -> None:
        if t <= self.t:
            await asyncio.sleep(0)
            return
        self.wake_at, self._fut = t, asyncio.get_running_loop().create_future()
        await self._fut

    async def advance(self) -> float:
        """Move to where the loop sleeps until, let it run to its next sleep; the time."""
        assert self._fut is not None and self.wake_at is not None
        self.t, fut, self._fut = self.wake_at, self._fut, None
        fut.set_result(None)
        for _ in range(5):
            await asyncio.sleep(0)
        return self.t


STEP = FittedStepTime(a=0.010, b=0.0, c=0.0, d=0.0, f=0.002, g=0.0001)   # 10 ms a step; 2 ms + 0.1 ms a token


def test_front_end_delays_the_request_and_lengthens_the_step_in_flight() -> None:
    async def go() -> None:
        clock = HandClock()
        eng = SteppedEngine(make_sched(), STEP, clock, Faults())   # type: ignore[arg-type]
        a, b = make_req(10, max_tokens=3, name="a"), make_req(20, max_tokens=3, name="b")
        eng.submit(a)                                   # idle engine: the core does a's front end (3 ms) first
        await asyncio.sleep(0)
        assert len(eng.sched.waiting) == 0 and clock.wake_at == pytest.approx(0.003)
        await clock.advance()                           # a joins; its prefill runs 3 → 13 ms
        assert clock.wake_at == pytest.approx(0.013) and a.num_computed_tokens == 10
        clock.t = 0.005
        eng.submit(b)                                   # mid-step: b's 4 ms lengthen it to 17 ms
        assert b.arrival == 0.005
        await clock.advance()
        assert clock.wake_at == pytest.approx(0.017) and a.first_token_at is None
        await clock.advance()
        assert a.first_token_at == pytest.approx(0.017)
        assert b in eng.sched.running and b.num_computed_tokens == 20   # b joined at the step's end, prefills next
        await clock.advance()                           # a decodes, b prefills: 17 → 27 ms
        assert b.first_token_at == pytest.approx(0.027)
        assert eng.describe()["front_model_s"] == pytest.approx(0.007)
        await eng.stop()
    asyncio.run(go())


def test_a_request_aborted_in_its_front_end_never_runs() -> None:
    async def go() -> None:
        clock = HandClock()
        eng = SteppedEngine(make_sched(), STEP, clock, Faults())   # type: ignore[arg-type]
        a, b = make_req(10, name="a"), make_req(10, name="b")
        eng.submit(a)
        eng.submit(b)                                   # queued behind a's front end: done at 6 ms
        await asyncio.sleep(0)
        eng.abort(b)
        await clock.advance()
        assert [r.request_id for r in eng.sched.running] == ["a"] and b.status.value == "aborted"
        await eng.stop()
    asyncio.run(go())


def test_old_fit_files_have_no_front_end_and_new_ones_round_trip(tmp_path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"form": "linear-v2", "a": 0.006, "b": 3e-5, "c": 3e-4, "d": 1e-6, "a_p": 0.003,
                               "e": 0.0017}))
    fit = load_fit(old)
    assert fit.f == fit.g == 0.0 and fit.front_seconds(500) == 0.0
    assert "f" not in fit.to_json()
    new = tmp_path / "new.json"
    with_front = FittedStepTime(0.006, 3e-5, 3e-4, 1e-6, a_p=0.003, e=0.0017, f=0.002, g=4e-6)
    new.write_text(json.dumps(with_front.to_json()))
    assert load_fit(new) == with_front and with_front.front_seconds(100) == pytest.approx(0.0024)


def _shape(rng: np.random.Generator) -> StepShape:
    pre = int(rng.integers(50, 900)) if rng.random() < 0.3 else 0
    rows = int(rng.integers(1, 32))
    return StepShape(prefill_tokens=pre, prefill_context=pre, prefill_rows=int(rng.integers(1, 4)) if pre else 0,
                     decode_rows=rows, decode_context=rows * int(rng.integers(20, 1500)))


def test_the_joint_fit_recovers_step_and_front_end_coefficients() -> None:
    """Runs whose time holds the front end of the requests that arrived in them, and idle first
    tokens, made from known coefficients: one least squares gives them all back."""
    truth = FittedStepTime(0.006, 2e-5, 4e-4, 1e-8, a_p=0.003, e=1e-3, f=0.002, g=5e-6)
    rng = np.random.default_rng(0)
    runs, ttfts = [], []
    for _ in range(400):
        shapes = tuple(_shape(rng) for _ in range(8))
        n = int(rng.integers(0, 6))
        tok = int(rng.integers(2, 600, n).sum()) if n else 0
        runs.append(FrontSample(shapes, n, tok, 0.0, "run"))
    for _ in range(40):
        p = int(rng.integers(2, 1000))
        ttfts.append(FrontSample((StepShape(prefill_tokens=p, prefill_context=p, prefill_rows=1),), 1, p, 0.0, "ttft"))
    made = [FrontSample(s.shapes, s.arrivals, s.arrival_tokens, s.predict(truth), s.kind) for s in runs + ttfts]
    fit = fit_front(made, FIT_FORM_V2)
    for k in ("a", "b", "c", "d", "a_p", "e", "f", "g"):
        assert getattr(fit, k) == pytest.approx(getattr(truth, k), rel=1e-4), k
    err = front_errors(fit, made)
    assert err["all"]["median"] < 1e-6 and err["ttft_idle"]["samples"] == 40
    # with 0.5 % noise and one run 10x too long (a GC pause): that run is dropped, the rest holds
    noisy = [FrontSample(s.shapes, s.arrivals, s.arrival_tokens, s.seconds * (1 + 0.005 * rng.standard_normal()),
                         s.kind) for s in made]
    noisy[0] = FrontSample(noisy[0].shapes, noisy[0].arrivals, noisy[0].arrival_tokens, 10 * noisy[0].seconds, "run")
    fit, kept = robust_front_fit(noisy[:400], noisy[400:], FIT_FORM_V2)
    assert noisy[0] not in kept and len(kept) > 430
    for k in ("a", "c", "f"):
        assert getattr(fit, k) == pytest.approx(getattr(truth, k), rel=0.05), k


def test_front_samples_count_arrivals_in_runs_and_keep_only_idle_first_tokens() -> None:
    # a: alone on an idle engine (sent at 0, first token at 15 ms, then one every 10 ms);
    # b: sent at 50 ms while a decodes (its first token is not idle); c: sent after both finished
    a = Trace(10, 0.0, [0.015 + 0.010 * i for i in range(20)], ok=True)
    b = Trace(30, 0.050, [0.068 + 0.010 * i for i in range(9)], ok=True)
    c = Trace(7, 1.0, [1.012, 1.022], ok=True)
    runs, spans, _ = step_runs_timed([a, b, c])
    front_runs, ttfts = front_samples([a, b, c], runs, spans)
    assert sorted(round(s.seconds, 3) for s in ttfts) == [0.012, 0.015]          # c's and a's TTFT
    assert [s.arrival_tokens for s in ttfts] == [10, 7]
    # a's first run (15 → 95 ms) saw b arrive (30 tokens); its second (95 → 175 ms) saw nothing
    assert [(s.arrivals, s.arrival_tokens) for s in front_runs[:2]] == [(1, 30), (0, 0)]


def test_a_request_arriving_during_anothers_front_end_waits_its_own() -> None:
    async def go() -> None:
        clock = HandClock()
        eng = SteppedEngine(make_sched(), STEP, clock, Faults())   # type: ignore[arg-type]
        a, b = make_req(10, name="a"), make_req(10, name="b")
        eng.submit(a)                                   # front end 0 → 3 ms
        await asyncio.sleep(0)
        clock.t = 0.001
        eng.submit(b)                                   # queued behind a's: 3 → 6 ms
        await clock.advance()                           # at 3 ms a alone joins, b's front end still runs
        assert [r.request_id for r in eng.sched.running] == [] and clock.wake_at == pytest.approx(0.006)
        await clock.advance()                           # at 6 ms both run one step: 6 → 16 ms
        assert {r.request_id for r in eng.sched.running} == {"a", "b"} and clock.wake_at == pytest.approx(0.016)
        await eng.stop()
    asyncio.run(go())
