"""cohort in front of simulated vLLM engines (``cohort engine-sim serve``, started by
``bench.fleet_bench.engine_fleet``): an engine that dies mid-stream loses nothing; KV-bound
engines are never made to preempt by cohort while a direct flood of the same requests makes them;
a priority cohort passes is the order the engine admits in; a repeated prefix lands on the engine
that holds it. Every assertion is on counts and orders, none on timing ratios."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import numpy as np
import pytest

from bench.fleet_bench import EngineSpec, engine_fleet, scrape
from cohort.settings import DEFAULT_MODEL
from cohort.tokenizer import build_prompt, prompt_token_ids
from tests.e2e.stack import TestStack

pytestmark = pytest.mark.e2e


@contextmanager
def cohort_fleet(folder: Path, n: int, spec: EngineSpec, per_engine=(), **env: str
                 ) -> Iterator[tuple[TestStack, list[str]]]:
    """``n`` engines with priority scheduling and a cohort stack in front of all of them."""
    with engine_fleet(n, spec, "priority", folder / "engines", per_engine=per_engine) as urls:
        # the relaying worker: tests/e2e/test_gateway_streaming.py runs these against the gateway's own streams
        env = {"COHORT_UPSTREAM_STREAMING": "worker", **env}
        stack = TestStack(folder / "stack", COHORT_UPSTREAMS=",".join(urls), COHORT_UPSTREAM_TIMEOUT_S="10", **env)
        try:
            stack.start()
            yield stack, urls
        finally:
            stack.stop()
            for name in stack.procs:
                print(stack.tail(name, 30))


async def _generate(url: str, bodies: list[dict], gap_s: float | list[float] = 0.0) -> list[tuple[httpx.Response, float]]:
    """POST each body to /v1/generate (``gap_s`` apart, or ``gap_s[i]`` after body i); each answer
    and when it came (monotonic)."""
    gaps = gap_s if isinstance(gap_s, list) else [gap_s] * len(bodies)
    async with httpx.AsyncClient(base_url=url, timeout=180) as h:
        async def one(b: dict) -> tuple[httpx.Response, float]:
            r = await h.post("/v1/generate", json=b)
            return r, time.monotonic()
        tasks = []
        for b, gap in zip(bodies, gaps, strict=True):
            tasks.append(asyncio.create_task(one(b)))
            if gap:
                await asyncio.sleep(gap)
        return await asyncio.gather(*tasks)


def _body(i: int, tokens: int, **extra) -> dict:
    return {"instruction": "Echo.", "input": f"item {i}", "max_tokens": tokens, "emulated_tokens": tokens, **extra}


def test_an_engine_that_dies_mid_stream_loses_nothing(tmp_path):
    spec = EngineSpec(num_gpu_blocks=24, max_model_len=352, speedup=0.5)  # ~2 rows per engine: both serve
    with cohort_fleet(tmp_path, 2, spec, per_engine=[["--die-after", "2"]]) as (stack, urls):
        answers = asyncio.run(_generate(stack.url, [_body(i, 120) for i in range(10)]))
        assert [r.status_code for r, _ in answers] == [200] * 10, [r.text for r, _ in answers]
        assert [r.json()["generated_tokens"] for r, _ in answers] == [120] * 10
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{urls[0].removesuffix('/v1')}/health", timeout=2)  # it did die
        assert int(stack.redis.hgetall("cohort:stats").get("requests_failed", 0)) == 0


def test_cohort_never_makes_kv_bound_engines_preempt_a_direct_flood_does(tmp_path):
    # 34 blocks of 16 (33 usable); every request is 120 tokens (8 blocks): cohort, planning with
    # max_tokens = the true length, fits 4 per engine, and a 5th joins only where the plan says the
    # rows it meets leave before it needs the pages; that holds because the plan counts the tokens
    # an engine streaming in chunks holds unsent (rows out of phase, as a loaded machine makes them,
    # were credited up to 7 tokens short each: a preemption); a direct flood admits every prompt at once
    spec = EngineSpec(num_gpu_blocks=34, max_model_len=512)
    prompts = [build_prompt("Echo.", f"item {i}") for i in range(16)]
    ids = prompt_token_ids(prompts, DEFAULT_MODEL)
    with cohort_fleet(tmp_path, 2, spec) as (stack, urls):
        bodies = [_body(i, 120 - len(p)) for i, p in enumerate(ids)]
        answers = asyncio.run(_generate(stack.url, bodies))
        assert [r.status_code for r, _ in answers] == [200] * 16
        assert [r.json()["generated_tokens"] for r, _ in answers] == [b["max_tokens"] for b in bodies]
        fleet = scrape(urls)
        assert fleet["finished"] >= 16 and fleet["preemptions"] == 0, fleet  # (+ each worker's start-up probe)

        async def flood() -> list[int]:
            async with httpx.AsyncClient(timeout=180) as h:
                rs = await asyncio.gather(*(h.post(f"{urls[0]}/completions", json={
                    "prompt": p, "max_tokens": 120 - len(p), "ignore_eos": True}) for p in ids))
            return [r.status_code for r in rs]

        assert asyncio.run(flood()) == [200] * 16
        assert scrape(urls[:1])["preemptions"] > 0


def test_the_engine_admits_in_the_priority_cohort_passes(tmp_path):
    # one engine running one request at a time: a long one runs, then A (priority 5) and B
    # (priority 1), sent together, both wait in the engine's queue, A sent first; the engine takes B
    # first only if cohort passed the priorities and the engine honours them. (Sent apart, B could
    # wait in cohort instead: the upstream worker holds groups back while the engine reports a queue.)
    spec = EngineSpec(max_num_seqs=1, speedup=0.5)
    with cohort_fleet(tmp_path, 1, spec) as (stack, urls):
        bodies = [_body(0, 300), _body(1, 8, priority=5), _body(2, 8, priority=1)]
        (long, t_long), (a, t_a), (b, t_b) = asyncio.run(_generate(stack.url, bodies, gap_s=[0.6, 0.0, 0.0]))
        assert [r.status_code for r in (long, a, b)] == [200] * 3
        assert t_long < t_b < t_a, (t_long, t_a, t_b)
        assert "priority on" in stack.tail("upstream-0", 200)


def test_a_repeated_prefix_lands_on_the_engine_that_holds_it(tmp_path):
    topics = ["static batching", "KV caches", "tokenizers", "speculative decoding", "LoRA adapters"]
    with cohort_fleet(tmp_path, 2, EngineSpec(), COHORT_SERVED_MODEL_NAME="cohort-tiny") as (stack, urls):
        def turn(topic: str, question: str) -> None:
            system = {"role": "system", "content": f"{topic}: you answer questions about {topic}, briefly. " * 8}
            r = httpx.post(f"{stack.url}/v1/chat/completions", timeout=120, json={
                "model": "cohort-tiny", "max_tokens": 3, "ignore_eos": True,
                "messages": [system, {"role": "user", "content": question}]})
            assert r.status_code == 200, r.text

        for t in topics:
            turn(t, "Why?")
        before = scrape(urls)
        for t in topics:
            turn(t, "And how?")
        after = scrape(urls)
        # each second turn found its system prompt (8 x ~12 tokens, at least 5 full blocks) cached
        # on the engine it went to: with a pool queue some would land on the other engine
        hits = [a["prefix_hits"] - b["prefix_hits"] for a, b in zip(after["per_engine"], before["per_engine"],
                                                                      strict=True)]
        assert sum(hits) >= len(topics) * 80, (hits, before, after)


def test_the_fleet_command_reports_the_solo_bound_no_target_beats(tmp_path):
    """``cohort bench fleet`` end to end on two simulated engines (direct targets only: no stack):
    the JSON holds each run and the solo bound, and no run's mean, p50 or p99 beats the bound."""
    from typer.testing import CliRunner

    from bench.cli import app

    out = tmp_path / "fleet.json"
    r = CliRunner().invoke(app, ["fleet", "--engines", "2", "--num-gpu-blocks", "48", "--speedup", "2",
                                 "--targets", "rr-fcfs,ll-fcfs", "--loads", "0.9", "--requests", "24",
                                 "--capacity", "20", "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    runs = json.loads(out.read_text())["by_load"]["0.9"]
    assert set(runs) == {"rr-fcfs", "ll-fcfs", "solo-bound"}
    bound = runs["solo-bound"]
    assert bound["done"] == 24 and "solo-bound" in r.output
    for t in ("rr-fcfs", "ll-fcfs"):
        assert runs[t]["done"] == 24
        for k in ("mean_latency_s", "p50_latency_s", "p99_latency_s"):
            assert runs[t][k] >= bound[k], (t, k)
        # request by request too: request i is the same request in every row
        for key in ("first", "done"):
            mine = np.subtract(runs[t]["per_request"][key], runs[t]["per_request"]["sent"])
            floor = np.subtract(bound["per_request"][key], bound["per_request"]["sent"])
            assert (mine >= floor - 1e-4).all(), (t, key, float((mine - floor).min()))


def test_the_fleet_command_measures_what_cohorts_own_processes_cost(tmp_path):
    """A cohort target of ``cohort bench fleet`` (a spawned stack in front of two simulated engines)
    answers every request, and its result holds the cores the front's own processes kept busy,
    by role, and the engines' share of late steps."""
    from typer.testing import CliRunner

    from bench.cli import app

    out = tmp_path / "fleet.json"
    r = CliRunner().invoke(app, ["fleet", "--engines", "2", "--num-gpu-blocks", "48", "--speedup", "2",
                                 "--targets", "spf", "--loads", "0.9", "--requests", "24",
                                 "--capacity", "20", "--workdir", str(tmp_path / "w"), "--json", str(out)])
    assert r.exit_code == 0, r.output + repr(r.exception)
    doc = json.loads(out.read_text())
    run = doc["by_load"]["0.9"]["spf"]
    assert run["done"] == 24 and 0.0 <= run["late_step_share"] <= 1.0 and "held_model_clock" in doc
    cores = run["front_cores"]
    assert set(cores) == {"gateway", "batcher", "worker", "redis"}
    assert cores["gateway"] > 0 and cores["worker"] > 0 and sum(cores.values()) < 2.5   # two cores here, a margin
    assert "front " in r.output and "cores" in r.output
