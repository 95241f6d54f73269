"""A row's life from its next-token logits to its next token — shared by the padded decode loop
(``workers.padded_run``, static and elastic execution) and the continuous engine
(``workers.continuous``), so both choose and stop tokens by the same rules.

``RowState`` is one request while it runs: its ids, sampler and limits. ``TokenStepper`` turns a
step's logits for a set of rows into their next tokens: EOS suppressed for emulated lengths and
``ignore_eos``, the batch's argmax for plain greedy rows (one op), the row's own transformers
logits processors otherwise, logprobs from the same processed scores the token was chosen from,
and the row finished on EOS, its emulated length or ``max_tokens``. Each token becomes a
``TokenEvent``; the text (stop strings, deltas, answers) is ``workers.row_text``'s: the padded
loop renders every event at once, the continuous engine leaves the events to its consumer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from cohort.protocol import FinishReason, TokenLogprob
from cohort.types import ProfiledRequest
from workers.row_text import TextStage
from workers.sampling import RowSampler, token_logprob
from workers.step_outputs import StepOutput, TokenEvent


class RowState:
    """A request while it runs."""

    def __init__(self, req: ProfiledRequest, prompt_ids: list[int], emulate: bool) -> None:
        self.req = req
        self.prompt_ids = prompt_ids
        self.new_ids: list[int] = []
        self.sampler = RowSampler(req.sampling, len(prompt_ids) + req.done_tokens)
        self.emulated = req.emulated_tokens if emulate else None
        self.limit = req.max_tokens if self.emulated is None else max(0, min(self.emulated, req.max_tokens))
        self.first_token_at = req.first_token_at
        self.top_logprobs = req.sampling.logprobs                     # None: no logprobs
        # The prompt's logprobs, once: not again for a continuation (its prompt has them already)
        fresh = not req.generated_ids and req.done_tokens == 0
        self.prompt_top = req.sampling.prompt_logprobs if fresh else None
        self.done: FinishReason | None = None  # set when the row ended (answered, stopped, failed)

    @property
    def all_ids(self) -> list[int]:
        return [*self.prompt_ids, *self.req.generated_ids, *self.new_ids]

    @property
    def total_tokens(self) -> int:
        return self.req.done_tokens + len(self.new_ids)

    @property
    def predicted_remaining(self) -> int:
        return max(0, self.req.predicted_tokens - len(self.new_ids))

    @property
    def planned_remaining(self) -> int:
        """Tokens memory planning still reserves for this row: its upper-quantile prediction
        (``planned_tokens``) less what it generated, never past what it may still generate."""
        return max(1, self.req.run_plan_tokens - len(self.new_ids))

    def continuation(self) -> ProfiledRequest:
        req = self.req if self.req.prompt_ids is not None else replace(self.req, prompt_ids=self.prompt_ids)
        return req.continuation(list(self.new_ids), self.first_token_at)


class TokenStepper:
    """Chooses rows' next tokens and applies their token limits; counts the tokens it generated.

    With a ``text`` stage each event is rendered at once into the step's output (a stop string
    ends its row in the same step); without one the events are left in ``out.tokens``.
    """

    def __init__(self, tokenizer, *, text: TextStage | None = None, clock: Callable[[], float] = time.time) -> None:
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.text, self.clock = text, clock
        self.generated = 0  # tokens generated (the worker adds them to cohort_generated_tokens_total)

    def accept(self, rows: Sequence[RowState], logits: torch.Tensor, out: StepOutput) -> list[int]:
        """Each row's next token from its logits row (``logits``: [len(rows), vocab]); rows already
        done get the pad id. Finished rows get ``done`` set."""
        scores = logits.float()
        live = [i for i, r in enumerate(rows) if r.done is None]
        hold = [i for i in live if rows[i].req.sampling.ignore_eos or (
            rows[i].emulated is not None and len(rows[i].new_ids) + 1 < rows[i].limit)]
        if hold and self.eos is not None:
            scores[hold, self.eos] = float("-inf")  # an emulated length / ignore_eos never sees EOS
        greedy = scores.argmax(dim=-1).tolist()
        tokens = [self.pad] * len(rows)
        now = self.clock()
        for i in live:
            row = rows[i]
            if row.sampler.plain_greedy:
                tok, processed = greedy[i], scores[i:i + 1]
            else:
                seq = torch.tensor([row.all_ids], device=scores.device)
                processed = row.sampler.process(seq, scores[i:i + 1])
                tok = row.sampler.choose(processed, row.total_tokens)
            tokens[i] = tok
            scored = None if row.top_logprobs is None else token_logprob(processed, tok, row.top_logprobs)
            self.advance(row, tok, now, out, scored)
        return tokens

    def advance(self, row: RowState, tok: int, now: float, out: StepOutput,
                scored: TokenLogprob | None = None) -> None:
        if row.limit == 0:
            self._emit(row, None, now, out, FinishReason.LENGTH)
            return
        if tok == self.eos and row.emulated is None:
            self._emit(row, None, now, out, FinishReason.STOP)
            return
        row.new_ids.append(tok)
        self.generated += 1
        if row.first_token_at is None:
            row.first_token_at = now
        finish = None
        if len(row.new_ids) >= row.limit:
            finish = FinishReason.LENGTH if len(row.new_ids) >= row.req.max_tokens else FinishReason.STOP
        self._emit(row, tok, now, out, finish, scored)

    def _emit(self, row: RowState, tok: int | None, now: float, out: StepOutput,
              finish: FinishReason | None, scored: TokenLogprob | None = None) -> None:
        ev = TokenEvent(row.req, tok, row.total_tokens, now, row.first_token_at, finish, scored)
        if finish is not None:
            row.done = finish
        if self.text is None:
            out.tokens.append(ev)
        elif self.text.apply(ev, out):
            row.done = FinishReason.STOP  # a stop string: the row ends this step

    def evict(self, row: RowState, out: StepOutput) -> None:
        """The row leaves to make room: what it generated is streamed (or its logprobs sent) and
        it is handed back as a continuation that resumes after those tokens."""
        if self.text is not None:
            self.text.evict(row.req, out)
        out.evicted.append(row.continuation())
        row.done = FinishReason.LENGTH
