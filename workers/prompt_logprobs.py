"""The prompt's own log-probabilities (OpenAI's ``echo`` with ``logprobs``, vLLM's
``prompt_logprobs``; what lm-eval's log-likelihood tasks read), from the prefill the worker runs
anyway: the logits at prompt position j score prompt token j+1.

Raw model log-probabilities (no temperature, penalties or top-k/top-p: those shape sampling, and
a prompt is not sampled), as vLLM reports them. The first token has no context: ``None``.
"""

from __future__ import annotations

import torch

from cohort.protocol import PromptLogprob
from workers.sampling import LOGPROB_FLOOR


def prompt_logprobs(logits: torch.Tensor, ids: list[int], top: int) -> list[PromptLogprob | None]:
    """``logits``: (len(ids) − 1, vocab), the prefill's logits at the positions before each of
    ``ids[1:]``. One entry per prompt token: None for the first, else ``[logprob, [[alt id,
    logprob], ...] (top most likely), rank of the prompt token (1 = most likely)]``."""
    out: list[PromptLogprob | None] = [None]
    if len(ids) < 2:
        return out
    logp = torch.log_softmax(logits.float(), dim=-1)
    target = torch.tensor(ids[1:], device=logp.device)
    chosen = logp.gather(1, target[:, None])[:, 0]
    ranks = (logp > chosen[:, None]).sum(dim=-1) + 1
    if top > 0:
        values, alt_ids = torch.topk(logp, min(top, logp.shape[-1]), dim=-1)
        alts = [[[int(i), max(LOGPROB_FLOOR, float(v))] for v, i in zip(vs, is_, strict=True)]
                for vs, is_ in zip(values.tolist(), alt_ids.tolist(), strict=True)]
    else:
        alts = [[] for _ in ids[1:]]
    for lp, alt, rank in zip(chosen.tolist(), alts, ranks.tolist(), strict=True):
        out.append([max(LOGPROB_FLOOR, float(lp)), alt, int(rank)])
    return out
