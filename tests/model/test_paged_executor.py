"""The paged, packed executor driven by the row book gives the same greedy tokens as HF
``generate`` run on each request alone: mixed prompt lengths, prefill chunked under a small token
budget, rows joining while others decode, rows leaving as they finish."""

import pytest
import torch

from batcher.running_set import RunningSet, RunRow
from workers.model import tiny_llama_config
from workers.paged_executor import PagedExecutor, packed_path_refusal

pytestmark = pytest.mark.model  # builds and runs a tiny Llama of its own


def _model():
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(tiny_llama_config(300, 0, 299, 1)).eval()


def test_greedy_equals_generate_with_chunked_prefill_and_staggered_joins():
    model = _model()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(2, 298, (n,), generator=gen).tolist() for n in (5, 37, 12, 60)]
    wants = [9, 4, 14, 6]
    ref = []
    for p, g in zip(prompts, wants, strict=True):
        o = model.generate(torch.tensor([p]), max_new_tokens=g, min_new_tokens=g, do_sample=False)
        ref.append(o[0, len(p):].tolist())

    assert packed_path_refusal(model) is None
    book = RunningSet(num_pages=64, page_size=8, token_budget=24)
    ex = PagedExecutor(model, book, torch.float32, torch.device("cpu"))
    tokens = {str(i): list(p) for i, p in enumerate(prompts)}
    got: dict[str, list[int]] = {str(i): [] for i in range(4)}
    seen_prompt: dict[str, int] = {}
    joins = {0: [0, 1], 3: [2], 6: [3]}  # step -> rows admitted as one group
    for step in range(200):
        if step in joins:
            assert book.admit([RunRow(str(i), len(prompts[i])) for i in joins[step]])
        plan = book.plan_step()
        last = ex.run(plan, tokens, lambda r, p0, lg: seen_prompt.__setitem__(r, seen_prompt.get(r, 0) + len(lg)))
        book.commit(plan)
        for row_id, lg in last.items():
            if book.rows[row_id].prefill_left:
                continue  # mid-prompt chunk: no token yet
            tok = int(lg.argmax())
            got[row_id].append(tok)
            tokens[row_id].append(tok)
            if len(got[row_id]) == wants[int(row_id)]:
                book.release(row_id)
        if not book.rows and step > max(joins):
            break
    assert [got[str(i)] for i in range(4)] == ref
    assert seen_prompt == {str(i): len(p) for i, p in enumerate(prompts)}  # every prompt position hooked once
    assert book.free_tokens == 64 * 8
