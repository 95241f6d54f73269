"""The simulator and the worker admit and evict the same rows on the same trace: both drive
``batcher.running_set.RunningSet``, the worker on the real model (emulated lengths), the simulator
on the roofline (true lengths). Admission and eviction follow steps, not seconds, so with every
group queued before the first step the two sequences must be equal step by step."""

from __future__ import annotations

import pytest
import torch

from bench.continuous import EngineLimits, SimInstance, StepStats
from bench.group_engine import GroupEngine, GroupScheduler
from bench.roofline import instance
from cohort.types import Batch, ProfiledRequest
from workers.continuous import ContinuousRun

PAGE, BUDGET = 4, 24
# (group, prompt words, true length, predicted length): under-predicted rows outgrow their plan and
# force evictions; the groups' sizes and lengths differ so the order of joins is not trivial
TRACE = [("g0", 6, 12, 4), ("g0", 3, 5, 5), ("g1", 8, 9, 2), ("g2", 5, 14, 3), ("g2", 2, 3, 3),
         ("g3", 7, 6, 6), ("g4", 4, 10, 1), ("g4", 6, 4, 4), ("g5", 3, 8, 8)]


def _requests(engine) -> tuple[dict[str, list[ProfiledRequest]], dict[str, list[int]]]:
    groups: dict[str, list[ProfiledRequest]] = {}
    ids: dict[str, list[int]] = {}
    for i, (g, words, true, pred) in enumerate(TRACE):
        rid = f"r{i}"
        ids[rid] = engine.prompt_ids(" ".join(["story"] * words))
        groups.setdefault(g, []).append(ProfiledRequest(
            id=rid, prompt="", input_tokens=len(ids[rid]), arrival=0.0, predicted_tokens=pred, max_tokens=64,
            emulated_tokens=true, true_tokens=true))
    return groups, ids


def _worker_log(engine, groups, ids, pages: int) -> list[tuple[int, str, str]]:
    run = ContinuousRun(engine.model, engine.tokenizer, engine.device, torch.float32, num_pages=pages,
                        page_size=PAGE, token_budget=BUDGET, emulate=True)
    for g, reqs in groups.items():
        run.submit(Batch(id=g, requests=reqs, created=0.0), [ids[r.id] for r in reqs])
    log: list[tuple[int, str, str]] = []
    for step in range(500):
        if run.idle:
            break
        outs = run.step()
        log += [(step, "admit", g) for g in run.just_admitted]
        log += [(step, "evict", rid) for o in outs.values() for rid in o.preempted]
        run.finished_groups()
    assert run.idle
    return log


class _Fixed:
    """A policy that hands out the trace's groups in order (the worker gets them in that order too)."""

    def __init__(self, groups: dict[str, list[ProfiledRequest]]) -> None:
        self.batches = [Batch(id=g, requests=reqs, created=0.0) for g, reqs in groups.items()]

    def add(self, req: ProfiledRequest, now: float) -> None:
        pass

    def pop(self, now: float) -> Batch | None:
        return self.batches.pop(0) if self.batches else None


def _sim_log(groups, pages: int) -> tuple[list[tuple[int, str, str]], int]:
    limits = EngineLimits(page_tokens=PAGE, max_batched_tokens=BUDGET)
    queue = GroupScheduler(_Fixed(groups), limits)  # type: ignore[arg-type]
    reqs = [r for rs in groups.values() for r in rs]
    for r in reqs:
        queue.add(r, 0.0)
    done: list[int] = []
    engine = GroupEngine(instance("a800-80gb", "llama-13b").time_model(), queue, limits, StepStats(),
                         lambda j, _t, ok: done.append(j) if ok else None, lambda _j, _t: None)
    inst = SimInstance(pages, limits)
    index = {r.id: j for j, r in enumerate(reqs)}
    log: list[tuple[int, str, str]] = []
    now, step = 0.0, 0
    while (end := engine.step(inst, now, index)) is not None:
        log += [(step, kind, what) for _t, _i, kind, what in engine.log]
        engine.log.clear()
        now, step = end, step + 1
    return log, len(done)


@pytest.mark.parametrize("pages", [10, 11, 13])
def test_worker_and_simulator_admit_and_evict_alike(engine, pages):
    groups, ids = _requests(engine)
    worker = _worker_log(engine, groups, ids, pages)
    sim, answered = _sim_log(groups, pages)
    assert answered == len(TRACE)
    assert any(kind == "evict" for _s, kind, _w in worker), "the trace must force evictions"
    assert worker == sim
