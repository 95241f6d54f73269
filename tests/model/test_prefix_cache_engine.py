"""The prefix cache on the real model: the next-token logits, and so the greedy tokens, are the
same with and without it (shared system prompts across groups, the choices of one request in one
group, rows evicted and resumed), while the cache answers most of the shared prompt tokens."""

from __future__ import annotations

import pytest
import torch

from tests.model.test_continuous import drive, finished, make_run, req

SYSTEM = "You are a careful assistant. Answer briefly and politely, in plain words. " * 3
QUESTIONS = ["Tell me a story.", "What is static batching?", "Name a colour.", "Tell me a story about a cat."]


def _joins(predicted: int | None, longer: int = 1):
    """Two requests at once (one with three choices), two more joining later with the same system
    prompt; ``predicted`` under-predicts every length (rows then outgrow the pages planned for them)."""
    kw = {} if predicted is None else {"predicted": predicted}
    first = [req(0, SYSTEM + QUESTIONS[0], max_tokens=12 * longer, **kw)] + \
        [req(i, SYSTEM + QUESTIONS[1], max_tokens=10 * longer, **kw) for i in (1, 2, 3)]
    later = [req(4, SYSTEM + QUESTIONS[2], max_tokens=8 * longer, **kw),
             req(5, SYSTEM + QUESTIONS[3], max_tokens=14 * longer, **kw)]
    return {0: [("A", first[:1]), ("B", first[1:])], 6: [("C", later)]}


def _recording(run) -> dict[tuple[str, int], torch.Tensor]:
    """The logits the executor hands back, by (row, position they predict from), first seen kept."""
    seen: dict[tuple[str, int], torch.Tensor] = {}
    inner = run.executor.run

    def run_and_record(plan, tokens, *a, **kw):
        at = {rid: start + n - 1 for rid, start, n in plan.prefill}
        at.update({rid: run.book.rows[rid].computed for rid in plan.decode})
        out = inner(plan, tokens, *a, **kw)
        for rid, logits in out.items():
            seen.setdefault((rid, at[rid]), logits.detach().clone())
        return out

    run.executor.run = run_and_record
    return seen


@pytest.mark.parametrize(("pages", "predicted"), [(256, None), (22, 1)])
def test_logits_and_tokens_are_the_same_with_and_without_the_prefix_cache(engine, pages, predicted):
    """256 pages: nothing evicted. 22 pages of 8 tokens, answers 3x longer and every length under-predicted: rows are
    evicted and resume by recompute, their prompts' pages found again in the cache."""
    got, logits, evictions = {}, {}, {}
    for salt in (None, "tiny"):
        run = make_run(engine, num_pages=pages, prefix_salt=salt)
        logits[salt] = _recording(run)
        outs, done, _ = drive(run, _joins(predicted, 1 if predicted is None else 3), engine)
        got[salt] = {rid: (f.text, f.tokens, f.finish_reason) for rid, f in finished(outs).items()}
        assert sorted(done) == ["A", "B", "C"] and len(got[salt]) == 6
        assert run.book.free_tokens == run.book.capacity_tokens
        evictions[salt] = run.evictions
        if salt is None:
            assert run.book.pool.hits == 0
        else:  # every prompt after the first reuses the system prompt's full pages
            assert run.book.pool.hits >= 5 * (len(engine.prompt_ids(SYSTEM)) // 8 - 1) * 8
    assert got[None] == got["tiny"]
    # shared pages count once: the cache never costs evictions (here it saves one of two)
    assert evictions["tiny"] <= evictions[None]
    if predicted is not None:
        assert evictions["tiny"] > 0   # a row evicted and resumed with the cache on
    same = [k for k in logits["tiny"] if k in logits[None]]  # the cached run skips the reused positions
    assert len(same) >= sum(f[1] for f in got[None].values())  # every generated token's logits at least
    for k in same:
        assert torch.allclose(logits[None][k], logits["tiny"][k], atol=1e-4), k
