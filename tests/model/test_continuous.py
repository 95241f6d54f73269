"""Continuous execution on the built-in model (real HF model, paged KV through AttentionInterface):
groups join while others decode, greedy tokens equal HF ``generate`` on each request alone, rows
leave as they finish, a row evicted for pages resumes with its tokens kept, cancellation, stop
strings, sampling with a seed, logprobs and prompt logprobs."""

from __future__ import annotations

import pytest
import torch

from batcher.preemption import SwapLink
from batcher.row_cost import OnlineStepCost
from cohort.protocol import FailureCode, FinishReason
from cohort.types import Batch, ProfiledRequest, SamplingParams
from tests.model.rendered import step_rendered
from workers.continuous import ContinuousRun, SwapPlan
from workers.engine import LLMEngine
from workers.swap_pool import HostSwapPool

PROMPTS = ["Translate to French: good morning", "Hi", "a much longer prompt about static batching " * 4,
           "Summarise: the cat sat on the mat", "one more request that joins late"]


def req(i: int, prompt: str, max_tokens: int = 20, **kw) -> ProfiledRequest:
    return ProfiledRequest(id=f"r{i}", prompt=prompt, input_tokens=len(prompt.split()), arrival=0.0,
                           predicted_tokens=kw.pop("predicted", max_tokens), max_tokens=max_tokens, **kw)


def make_run(engine: LLMEngine, num_pages: int = 256, page_size: int = 8, budget: int = 16, **kw) -> ContinuousRun:
    return ContinuousRun(engine.model, engine.tokenizer, engine.device, torch.float32, num_pages=num_pages,
                         page_size=page_size, token_budget=budget, **kw)


def submit(run: ContinuousRun, engine: LLMEngine, bid: str, reqs: list[ProfiledRequest]) -> None:
    run.submit(Batch(id=bid, requests=reqs, created=0.0), [engine.prompt_ids(r.prompt) for r in reqs])


def drive(run: ContinuousRun, joins=None, engine=None, limit: int = 2000):
    """Step until idle; ``joins``: step -> (batch id, requests) submitted before that step."""
    outs, done_groups, admitted, stages = {}, [], {}, {}
    for step in range(limit):
        for bid, reqs in (joins or {}).get(step, []):
            submit(run, engine, bid, reqs)
        if run.idle and step > max((joins or {0: 0}), default=0):
            break
        for bid, o in step_rendered(run, stages).items():
            outs.setdefault(bid, []).append(o)
        for bid in run.just_admitted:
            admitted[bid] = step
        done_groups += [g.batch.id for g in run.finished_groups()]
    return outs, done_groups, admitted


def finished(outs) -> dict:
    return {f.request.id: f for os_ in outs.values() for o in os_ for f in o.finished}


def reference(engine: LLMEngine, prompt: str, n: int) -> list[int]:
    tok = engine.tokenizer
    ids = torch.tensor([engine.prompt_ids(prompt)])
    out = engine.model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=tok.pad_token_id,
                                eos_token_id=tok.eos_token_id)[0, ids.shape[1]:].tolist()
    return out[:out.index(tok.eos_token_id)] if tok.eos_token_id in out else out


@pytest.fixture(scope="session")
def refs(shared_engine) -> dict[str, list[int]]:
    # once per run: HF ``generate`` on the shared model (outside a packed step its paged
    # attention is plain SDPA, so a ContinuousRun that ran on it before changes nothing)
    return {p: reference(shared_engine, p, 24) for p in PROMPTS}


def test_groups_join_mid_run_and_greedy_equals_generate(engine, refs):
    run = make_run(engine)
    a = [req(i, PROMPTS[i], max_tokens=m) for i, m in ((0, 24), (1, 5), (2, 16))]
    b = [req(3, PROMPTS[3], max_tokens=11), req(4, PROMPTS[4], max_tokens=20)]
    outs, done, admitted = drive(run, {0: [("A", a)], 4: [("B", b)]}, engine)
    got = finished(outs)
    assert admitted == {"A": 0, "B": 4}  # B joined at a step boundary while A's rows decoded
    assert sorted(done) == ["A", "B"]
    for r in a + b:
        want = refs[r.prompt][:r.max_tokens]
        assert got[r.id].text == engine.tokenizer.decode(want, skip_special_tokens=True), r.id
        assert got[r.id].tokens == len(want)
    streamed = {r.id: sum(len(d[3]) for o in outs[bid] for d in o.deltas if d[0].id == r.id)
                for bid, rs in (("A", a), ("B", b)) for r in rs}
    assert streamed == {r.id: got[r.id].tokens for r in a + b}
    assert run.book.free_tokens == run.book.capacity_tokens


def test_the_run_prices_rows_with_its_own_measured_steps(engine):
    """COHORT_CONTINUOUS__MARGINAL_COST on a real run: every step the executor runs teaches the
    book's step cost (``batcher.row_cost.OnlineStepCost``), which the join rule then reads."""
    run = make_run(engine, emulate=True, marginal_cost=0.815)
    run.book.step_cost = OnlineStepCost(min_steps=8, refit=1, min_row_spread=0.3)
    reqs = [req(i, PROMPTS[i], max_tokens=30, emulated_tokens=n) for i, n in ((0, 20), (1, 12), (2, 16))]
    drive(run, {0: [("A", reqs[:2])], 3: [("B", reqs[2:])]}, engine)
    cost = run.book.step_cost
    assert cost.steps >= 20                     # one observation per step that ran work
    assert cost.coefficients is not None and min(cost.coefficients) >= 0
    assert cost.decode_seconds(1, 16) > 0
    assert run.book.judge.marginal_cost == 0.815


def test_rows_leave_as_they_finish_and_a_group_ends_with_its_last_row(engine):
    run = make_run(engine, emulate=True)
    reqs = [req(i, PROMPTS[i], max_tokens=30, emulated_tokens=n) for i, n in ((0, 3), (1, 12), (3, 7))]
    outs, done, _ = drive(run, {0: [("A", reqs)]}, engine)
    got = finished(outs)
    assert {k: (v.tokens, v.finish_reason) for k, v in got.items()} == {
        "r0": (3, FinishReason.STOP), "r1": (12, FinishReason.STOP), "r3": (7, FinishReason.STOP)}
    assert done == ["A"]


def test_a_group_waits_until_its_plan_fits_beside_the_running_rows(engine):
    # 14 pages of 8 tokens (112): A's rows plan 6 + 30 and 1 + 30 tokens, B 10 + 30: too much at
    # first; B joins once A's rows are far enough along that the peak of all three fits, while they run
    run = make_run(engine, num_pages=14, emulate=True)
    a = [req(0, PROMPTS[0], max_tokens=30, emulated_tokens=30), req(1, PROMPTS[1], max_tokens=30, emulated_tokens=30)]
    b = [req(3, PROMPTS[3], max_tokens=30, emulated_tokens=5, predicted=30)]
    outs, done, admitted = drive(run, {0: [("A", a), ("B", b)]}, engine)
    assert admitted["A"] == 0 and 0 < admitted["B"] < 29  # B waited, then joined while A ran
    assert sorted(done) == ["A", "B"] and len(finished(outs)) == 3


def test_the_row_cap_holds_a_group_until_a_row_leaves(engine):
    # pages to spare, but at most 2 rows at once (COHORT_CONTINUOUS__MAX_ROWS): B joins the step
    # after A's short row leaves, and every row is answered
    run = make_run(engine, emulate=True, max_rows=2)
    a = [req(0, PROMPTS[0], max_tokens=30, emulated_tokens=4), req(1, PROMPTS[1], max_tokens=30, emulated_tokens=20)]
    b = [req(3, PROMPTS[3], max_tokens=30, emulated_tokens=5)]
    outs, done, admitted = drive(run, {0: [("A", a), ("B", b)]}, engine)
    assert admitted["A"] == 0 and 4 <= admitted["B"] < 20
    assert sorted(done) == ["A", "B"] and len(finished(outs)) == 3


def test_an_evicted_row_resumes_with_its_tokens_kept(engine, refs):
    # predictions far too short: the plan admits everyone, pages run out mid-decode, rows are evicted
    run = make_run(engine, num_pages=10, page_size=8)
    reqs = [req(i, PROMPTS[i], max_tokens=24, predicted=1) for i in (0, 1, 3)]
    outs, done, _ = drive(run, {0: [("A", reqs)]}, engine)
    got = finished(outs)
    assert run.evictions > 0 and done == ["A"]
    for r in reqs:
        assert got[r.id].text == engine.tokenizer.decode(refs[r.prompt][:24], skip_special_tokens=True), r.id


def test_a_row_that_cannot_fit_alone_fails_with_out_of_memory(engine):
    run = make_run(engine, num_pages=2, page_size=8)
    outs, done, _ = drive(run, {0: [("A", [req(2, PROMPTS[2], max_tokens=4)])]}, engine)
    failed = [f for o in outs["A"] for f in o.failed]
    assert [(f[0].id, f[1]) for f in failed] == [("r2", FailureCode.OUT_OF_MEMORY)] and done == ["A"]


def test_cancelled_rows_stop_and_free_their_pages(engine):
    run = make_run(engine, emulate=True)
    reqs = [req(0, PROMPTS[0], max_tokens=50, emulated_tokens=50), req(1, PROMPTS[1], max_tokens=5, emulated_tokens=5)]
    submit(run, engine, "A", reqs)
    for _ in range(4):
        run.step()
    run.cancel(["r0"])
    outs, done, _ = drive(run)
    assert "r0" not in finished(outs) and done == ["A"]
    assert run.book.free_tokens == run.book.capacity_tokens


def test_stop_strings_sampling_seeds_and_logprobs(engine):
    text = engine.tokenizer.decode(reference(engine, PROMPTS[0], 12), skip_special_tokens=True)
    stop = text.split()[2] if len(text.split()) > 2 else text[:3]
    sp = SamplingParams(temperature=0.8, seed=7, logprobs=2)
    reqs = [req(0, PROMPTS[0], max_tokens=12, sampling=SamplingParams(stop=(stop,))),
            req(1, PROMPTS[3], max_tokens=8, sampling=sp), req(2, PROMPTS[3], max_tokens=8, sampling=sp)]
    run = make_run(engine)
    got = finished(drive(run, {0: [("A", reqs)]}, engine)[0])
    assert stop not in got["r0"].text and got["r0"].finish_reason is FinishReason.STOP
    assert got["r1"].text == got["r2"].text  # same seed, same tokens, whatever else ran beside them


def test_prompt_logprobs_come_from_the_chunked_prefill(engine):
    r = req(0, PROMPTS[2], max_tokens=1, sampling=SamplingParams(prompt_logprobs=1))
    run = make_run(engine, budget=8)  # the prompt is prefilled in several chunks
    outs, _, _ = drive(run, {0: [("A", [r])]}, engine)
    scores = [p for o in outs["A"] for p in o.prompt_scores]
    ids = engine.prompt_ids(r.prompt)
    assert len(scores) == 1 and scores[0][1] == ids and len(scores[0][2]) == len(ids)
    assert scores[0][2][0] is None and all(s is not None for s in scores[0][2][1:])


def _swap_plan(engine: LLMEngine, mode: str, link_bytes_per_s: float, host_tokens: int = 10**6) -> SwapPlan:
    return SwapPlan(mode, HostSwapPool(host_tokens, pin=False), SwapLink(link_bytes_per_s, link_bytes_per_s),
                    engine.delta_bytes, prefill_s_per_token=1e-4)


@pytest.mark.parametrize("mode, link, swapped", [("swap", 1e9, True), ("adaptive", 1e12, True),
                                                 ("adaptive", 1e3, False), ("recompute", 1e12, False)])
def test_swapped_or_recomputed_rows_give_the_tokens_of_an_uninterrupted_run(engine, refs, mode, link, swapped):
    """AdaptiveLLM: an evicted row's KV goes to the host pool and back (swap) or is prefilled again
    (recompute); adaptive swaps only when the link makes it cheaper. Greedy tokens never change."""
    run = make_run(engine, num_pages=10, page_size=8, swap=_swap_plan(engine, mode, link))
    reqs = [req(i, PROMPTS[i], max_tokens=24, predicted=1) for i in (0, 1, 3)]
    got = finished(drive(run, {0: [("A", reqs)]}, engine)[0])
    assert run.evictions > 0
    assert (run.swaps > 0) is swapped and (run.swaps == run.evictions or not swapped)
    assert run.swap.pool.used == 0  # every copy came back
    for r in reqs:
        assert got[r.id].text == engine.tokenizer.decode(refs[r.prompt][:24], skip_special_tokens=True), r.id


def test_a_full_host_pool_falls_back_to_recompute(engine, refs):
    run = make_run(engine, num_pages=10, page_size=8, swap=_swap_plan(engine, "swap", 1e9, host_tokens=4))
    reqs = [req(i, PROMPTS[i], max_tokens=24, predicted=1) for i in (0, 1, 3)]
    got = finished(drive(run, {0: [("A", reqs)]}, engine)[0])
    assert run.evictions > 0 and run.swaps == 0
    assert all(got[r.id].text == engine.tokenizer.decode(refs[r.prompt][:24], skip_special_tokens=True) for r in reqs)


def test_background_rows_give_way_to_an_urgent_group_and_resume_with_their_kv(engine, refs):
    """A job's rows (priority 10) pause, resident, while an interactive group (priority 0) runs
    (min duty 0), then finish with the tokens of an uninterrupted run (their KV was kept)."""
    from batcher.row_priority import StepShares
    run = make_run(engine, shares=StepShares(span=10, slowdown=0.0, min_duty=0.0))
    job = [req(i, PROMPTS[i], max_tokens=24, priority=10) for i in (0, 3)]
    urgent = [req(1, PROMPTS[1], max_tokens=5)]
    late = [req(4, PROMPTS[4], max_tokens=6, priority=10)]  # a job group arriving while the urgent one runs
    submit(run, engine, "J", job)
    moved: list[set[str]] = []
    outs: dict = {}
    stages: dict = {}
    admitted: dict[str, int] = {}
    for step in range(200):
        if step == 4:
            submit(run, engine, "I", urgent)
        if step == 5:
            submit(run, engine, "L", late)
        if run.idle:
            break
        step_outs = step_rendered(run, stages)
        admitted.update({bid: step for bid in run.just_admitted})
        moved.append({d[0].id for o in step_outs.values() for d in o.deltas} |
                     {f.request.id for o in step_outs.values() for f in o.finished})
        for bid, o in step_outs.items():
            outs.setdefault(bid, []).append(o)
        run.finished_groups()
    urgent_steps = [i for i, m in enumerate(moved) if "r1" in m]
    assert urgent_steps and urgent_steps[0] == 4  # admitted at once, prefilled and first token in one step
    during = moved[4:urgent_steps[-1] + 1]
    assert all(not (m & {"r0", "r3", "r4"}) for m in during)  # the job's rows did not step meanwhile
    assert admitted["L"] == 5  # the late job group joined at once (resident, waiting), not held up
    assert any(m & {"r0", "r3"} for m in moved[:4]) and any(m & {"r0", "r3"} for m in moved[urgent_steps[-1] + 1:])
    got = finished(outs)
    for r in job + urgent + late:
        assert got[r.id].text == engine.tokenizer.decode(refs[r.prompt][:r.max_tokens], skip_special_tokens=True), r.id
    assert run.book.free_tokens == run.book.capacity_tokens
