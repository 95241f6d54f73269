"""Per-row sampling with transformers' own logits processors and warpers.

Every row of a batch has its own ``SamplingParams``: its own processor list and, when seeded, a
generator reseeded per position (seed, token index), so a seeded request gives the same tokens
whatever batch it shares and however often it is preempted and resumed.
"""

from __future__ import annotations

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from cohort.types import SamplingParams

_SEED_MOD = 2**63 - 1
_SEED_STRIDE = 1_000_003


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's presence and frequency penalties over the tokens generated so far (transformers
    has only the multiplicative repetition penalty): logit −= presence·[count>0] + frequency·count."""

    def __init__(self, presence: float, frequency: float, prompt_len: int) -> None:
        self.presence, self.frequency, self.prompt_len = presence, frequency, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        generated = input_ids[:, self.prompt_len:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores)
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


def build_processors(p: SamplingParams, prompt_len: int) -> LogitsProcessorList:
    """The processor chain for one row, in HF ``generate``'s order: penalties and biases, then
    the warpers (temperature, top-k, top-p) when it samples."""
    procs = LogitsProcessorList()
    if p.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
    if p.presence_penalty or p.frequency_penalty:
        procs.append(PresenceFrequencyPenalty(p.presence_penalty, p.frequency_penalty, prompt_len))
    if p.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(tok,): bias for tok, bias in p.logit_bias}))
    if not p.greedy:
        procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
    return procs


class RowSampler:
    """Picks one row's next token from its logits."""

    def __init__(self, params: SamplingParams, prompt_len: int) -> None:
        self.params = params
        self.processors = build_processors(params, prompt_len)
        self._gen: torch.Generator | None = None

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits: the batch can take these rows' tokens in one vectorised op."""
        return self.params.greedy and not self.processors

    def process(self, seq: torch.LongTensor, logits: torch.FloatTensor) -> torch.FloatTensor:
        """The row's scores after its processors: the distribution it samples from (1, vocab).
        ``seq``: the row's tokens so far (1, n) incl. prompt."""
        return self.processors(seq, logits.float()) if self.processors else logits.float()

    def sample(self, seq: torch.LongTensor, logits: torch.FloatTensor, position: int) -> int:
        """``seq``: the row's tokens so far (1, n) incl. prompt; ``logits``: (1, vocab);
        ``position``: index of the token being generated in the whole answer."""
        return self.choose(self.process(seq, logits), position)

    def choose(self, scores: torch.FloatTensor, position: int) -> int:
        """The next token from processed ``scores`` (``process``)."""
        if self.params.greedy:
            return int(scores.argmax(dim=-1))
        gen = None
        if self.params.seed is not None:
            if self._gen is None:
                self._gen = torch.Generator(device=scores.device)
            self._gen.manual_seed((self.params.seed * _SEED_STRIDE + position) % _SEED_MOD)
            gen = self._gen
        return draw(scores[0], torch.rand((), generator=gen, device=scores.device, dtype=torch.float64))


def draw(scores: torch.Tensor, u: torch.Tensor) -> int:
    """The token whose share of the softmax of ``scores`` (vocab,) covers ``u`` ∈ [0, 1): inverse
    CDF sampling, one uniform number per token. Why not ``torch.multinomial``: on a CPU it draws a
    random number for every vocabulary entry, ~1 ms a token at a 32k vocabulary — a cost per row
    of every step, which made the engine's steps grow with its rows (docs/notes/steady.md). The CDF is
    summed in float64 and searched from the right, so a token the processors ruled out (−inf,
    probability 0) is never drawn."""
    weights = torch.softmax(scores.double(), dim=-1)
    cdf = torch.cumsum(weights, dim=-1)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if i >= len(cdf) or weights[i] == 0:  # u·total rounded onto the last step: the last token that can occur
        i = int(torch.nonzero(weights).max())
    return i


LOGPROB_FLOOR = -9999.0  # what -inf (a token the processors ruled out) is reported as: JSON has no -inf


def token_logprob(scores: torch.FloatTensor, token: int, top: int) -> list:
    """A generated token's log-probability and the ``top`` most likely alternatives, from the
    processed ``scores`` (1, vocab) the token was chosen from: ``[logprob, [[id, logprob], ...]]``
    (cohort.protocol.TokenLogprob)."""
    logp = torch.log_softmax(scores.float(), dim=-1)[0]
    alts: list[list] = []
    if top > 0:
        values, ids = torch.topk(logp, min(top, logp.shape[-1]))
        alts = [[int(i), max(LOGPROB_FLOOR, float(v))] for v, i in zip(values.tolist(), ids.tolist(), strict=True)]
    return [max(LOGPROB_FLOOR, float(logp[token])), alts]
