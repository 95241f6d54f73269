"""A row's life from its next-token logits to what its client sees — shared by the padded decode
loop (``workers.decode``, static and elastic execution) and the continuous engine
(``workers.continuous``), so both choose, stop, stream and score tokens by the same rules.

``RowState`` is one request while it runs: its ids, sampler, detokenizer and what it has not
streamed yet. ``TokenStepper`` turns a step's logits for a set of rows into their next tokens:
EOS suppressed for emulated lengths and ``ignore_eos``, the batch's argmax for plain greedy rows
(one op), the row's own transformers logits processors otherwise, logprobs from the same
processed scores the token was chosen from, stop strings held back until they can no longer
match, and the row finished on EOS, a stop string, its emulated length or ``max_tokens``.
When the caller does not stream (static execution) answers are held until ``release``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from cohort.protocol import FinishReason, ScoredIds, TokenLogprob
from cohort.types import ProfiledRequest
from workers.decode_outputs import RowResult, StepOutput
from workers.detokenize import IncrementalDetokenizer
from workers.sampling import RowSampler, token_logprob


class RowState:
    """A request while it runs."""

    def __init__(self, req: ProfiledRequest, prompt_ids: list[int], tokenizer, emulate: bool) -> None:
        self.req = req
        self.prompt_ids = prompt_ids
        self.new_ids: list[int] = []
        self.sampler = RowSampler(req.sampling, len(prompt_ids) + req.done_tokens)
        self.detok = IncrementalDetokenizer(tokenizer, req.generated_ids)
        self.max_stop = max((len(s) for s in req.sampling.stop), default=0)
        self.emulated = req.emulated_tokens if emulate else None
        self.limit = req.max_tokens if self.emulated is None else max(0, min(self.emulated, req.max_tokens))
        self.first_token_at = req.first_token_at
        self.sent = len(self.detok.text()) if req.generated_ids else 0  # chars streamed so far
        self.pending = ""                                             # decoded, held back for stops
        self.unsent_ids: list[int] = []                               # generated, not yet on the stream
        self.top_logprobs = req.sampling.logprobs                     # None: no logprobs
        # The prompt's logprobs, once: not again for a continuation (its prompt has them already)
        fresh = not req.generated_ids and req.done_tokens == 0
        self.prompt_top = req.sampling.prompt_logprobs if fresh else None
        self.unsent_logprobs: list[TokenLogprob] = []                 # one per unsent id (when asked)
        self.done: RowResult | None = None

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
        return max(1, min(self.req.planned_tokens, self.req.max_tokens) - len(self.new_ids))

    def continuation(self) -> ProfiledRequest:
        req = self.req if self.req.prompt_ids is not None else replace(self.req, prompt_ids=self.prompt_ids)
        return req.continuation(list(self.new_ids), self.first_token_at)


class TokenStepper:
    """Chooses rows' next tokens and applies their stop rules; counts the tokens it generated."""

    def __init__(self, tokenizer, *, streaming: bool = True, clock: Callable[[], float] = time.time) -> None:
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        self.streaming, self.clock = streaming, clock
        self.generated = 0  # tokens generated (the worker adds them to cohort_generated_tokens_total)
        self.held: list[tuple[RowState, RowResult]] = []  # not streaming: answers wait for ``release``

    def accept(self, rows: Sequence[RowState], logits: torch.Tensor, out: StepOutput) -> list[int]:
        """Each row's next token from its logits row (``logits``: [len(rows), vocab]); rows already
        done get the pad id. Finished rows get ``done`` set and land in ``out`` (or ``held``)."""
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
            self.finish(row, FinishReason.LENGTH, now, out)
            return
        if tok == self.eos and row.emulated is None:
            self.finish(row, FinishReason.STOP, now, out)
            return
        row.new_ids.append(tok)
        row.unsent_ids.append(tok)
        self.generated += 1
        if scored is not None:
            row.unsent_logprobs.append(scored)
        if row.first_token_at is None:
            row.first_token_at = now
        row.pending += row.detok.push(tok)
        if row.max_stop:
            text = row.detok.text()
            for s in row.req.sampling.stop:
                cut = text.find(s, max(0, row.sent - len(s)))
                if cut >= 0:
                    row.pending = text[row.sent:cut]
                    self.finish(row, FinishReason.STOP, now, out, text=text[:cut])
                    return
        if len(row.new_ids) >= row.limit:
            reason = FinishReason.LENGTH if len(row.new_ids) >= row.req.max_tokens else FinishReason.STOP
            self.finish(row, reason, now, out)
            return
        keep = row.max_stop - 1 if row.max_stop else 0
        self.send(row, len(row.pending) - keep, out)

    def send(self, row: RowState, n: int, out: StepOutput) -> None:
        """Stream the first ``n`` pending characters with every token id not yet streamed (a
        delta may carry ids and no text: held-back text still records the tokens)."""
        if not self.streaming:
            return
        text = row.pending[:max(0, n)]
        if not text and not row.unsent_ids:
            return
        out.deltas.append((row.req, text, row.total_tokens, self.take_ids(row)))
        row.sent += len(text)
        row.pending = row.pending[len(text):]

    @staticmethod
    def take_ids(row: RowState) -> list[int]:
        """The row's unsent ids (with their logprobs when it asked for them), now sent."""
        ids = row.unsent_ids if row.top_logprobs is None else ScoredIds(row.unsent_ids, row.unsent_logprobs)
        row.unsent_ids, row.unsent_logprobs = [], []
        return ids

    def send_scores(self, row: RowState, out: StepOutput) -> None:
        """Without streaming logprobs have no other way to the client: the row's unsent ids and
        logprobs go out in one delta without text (the end event has the text)."""
        if not self.streaming and row.top_logprobs is not None and row.unsent_ids:
            out.deltas.append((row.req, "", row.total_tokens, self.take_ids(row)))

    def flush(self, row: RowState, out: StepOutput) -> None:
        self.send(row, len(row.pending), out)

    def finish(self, row: RowState, reason: FinishReason, now: float, out: StepOutput,
               text: str | None = None) -> None:
        self.flush(row, out)
        full = row.detok.text() if text is None else text
        row.done = RowResult(row.req, full, row.total_tokens, reason, row.first_token_at, now)
        if self.streaming:
            out.finished.append(row.done)
        else:
            self.held.append((row, row.done))

    def evict(self, row: RowState, out: StepOutput) -> None:
        """The row leaves to make room: what it generated is streamed (or its logprobs sent) and
        it is handed back as a continuation that resumes after those tokens."""
        self.flush(row, out)
        self.send_scores(row, out)
        out.evicted.append(row.continuation())
        row.done = RowResult(row.req, "", row.total_tokens, FinishReason.LENGTH, row.first_token_at, self.clock())

    def release(self, out: StepOutput) -> None:
        """Answers held back (no streaming) go out now: that is when each client gets its first
        (and last) text, so both times are the release time."""
        if not self.held:
            return
        now = self.clock()
        for row, res in self.held:
            self.send_scores(row, out)
            out.finished.append(replace(res, first_token_at=now, finished_at=now))
        self.held = []
