"""The continuous engine's CUDA safety net, on a real GPU (skipped without one): with the device
filled until a big packed prefill cannot fit beside the page pool, the step's out-of-memory error
is caught, the step retried with smaller chunks (then fewer rows), and every row still gets the
greedy tokens of an undisturbed run."""

from __future__ import annotations

import pytest
import torch

from cohort.types import Batch, ProfiledRequest
from tests.model.rendered import step_rendered
from workers.continuous import ContinuousRun
from workers.model import tiny_llama_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _fill_device(leave_bytes: int) -> list[torch.Tensor]:
    """Allocate until about ``leave_bytes`` of device memory stay free."""
    torch.cuda.empty_cache()
    blocks, chunk = [], 1 << 30
    while chunk >= 1 << 20:
        free, _ = torch.cuda.mem_get_info()
        if free - chunk < leave_bytes:
            chunk //= 2
            continue
        try:
            blocks.append(torch.empty(chunk, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            chunk //= 2
    return blocks


def test_a_step_that_runs_out_of_device_memory_is_retried_and_loses_nothing():
    from transformers import LlamaForCausalLM

    from cohort.tokenizer import load_tokenizer

    tok = load_tokenizer()  # the built-in tokenizer (pad and EOS set)
    torch.manual_seed(0)
    cfg = tiny_llama_config(len(tok), tok.pad_token_id, tok.eos_token_id, None)
    # wide enough that a 12,000-token packed prefill needs ~150 MB of activations, 2,000 tokens ~25
    cfg.hidden_size, cfg.intermediate_size, cfg.num_attention_heads, cfg.num_key_value_heads = 512, 2048, 8, 4
    cfg.head_dim = 64
    model = LlamaForCausalLM(cfg).to("cuda", torch.float16).eval()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1000, len(tok) - 2, (3000,), generator=gen).tolist() for _ in range(4)]
    want = []
    for p in prompts:
        o = model.generate(torch.tensor([p], device="cuda"), max_new_tokens=6, min_new_tokens=6, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        want.append(o[0, len(p):].tolist())
    run = ContinuousRun(model, tok, torch.device("cuda"), torch.float16, num_pages=1024, page_size=16,
                        token_budget=16384)
    reqs = [ProfiledRequest(id=f"r{i}", prompt="", input_tokens=len(p), predicted_tokens=6, max_tokens=6,
                            arrival=0.0, prompt_ids=p) for i, p in enumerate(prompts)]
    run.submit(Batch(id="A", requests=reqs, created=0.0), prompts)
    blocks = _fill_device(leave_bytes=64 << 20)
    try:
        got: dict[str, list[int]] = {}
        stages: dict = {}
        for _ in range(500):
            if run.idle:
                break
            for o in step_rendered(run, stages).values():
                for d in o.deltas:
                    got.setdefault(d[0].id, []).extend(d[3])
                assert not o.failed
            run.finished_groups()
    finally:
        del blocks
        torch.cuda.empty_cache()
    assert run.ooms > 0 and run.book.token_budget < 16384  # the error happened and was survived
    assert [got[f"r{i}"] for i in range(4)] == want
