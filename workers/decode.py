"""One batch's decode loop: prefill the left-padded batch, then one token per step on the model's
KV cache (transformers' DynamicCache), with rows leaving as they finish.

Admission is static — the rows are fixed when the batch starts — but departure is elastic:
- a row that finishes (EOS, max_tokens, a stop string, its emulated length) is reported at
  once and, under ``elastic`` execution, its KV rows are dropped (``batch_select_indices``), so
  the rest decode with a smaller β and less memory; under ``static`` execution (the papers)
  every row stays in the batch and every answer is released when the last row ends;
- before a step whose KV would not fit (the CPU budget, or ``torch.cuda.OutOfMemoryError``
  raised inside the step) the batch either evicts rows as *continuations* that keep their
  generated tokens (``preempt``, rows chosen by ``batcher.elastic.eviction_order``) or gives up
  so the batcher can split it (``split``, Magnus's recovery);
- a cancelled row is dropped at the next step.

Greedy rows without penalties take the batch's argmax in one op; other rows go through their
own transformers logits processors (workers.sampling). Greedy output equals HF ``generate`` on
the same batch. A row that asked for logprobs gets each token's log-probability (and the top
alternatives) from the same processed scores its token was chosen from; they ride on its
deltas' ids (``ScoredIds``). Under static execution, where nothing is streamed before the
batch ends, they go out as one text-less delta at the release (or when the row is evicted).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Literal

import torch
from transformers import DynamicCache

from batcher.elastic import eviction_order, next_step_kv_tokens
from cohort.protocol import FailureCode, FinishReason, ScoredIds, TokenLogprob
from cohort.types import ProfiledRequest
from workers.decode_outputs import KVCacheOutOfMemory, RowResult, StepOutput
from workers.detokenize import IncrementalDetokenizer
from workers.prompt_logprobs import prompt_logprobs
from workers.sampling import RowSampler, token_logprob


class _Row:
    """A request while it is in the batch."""

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

    def continuation(self) -> ProfiledRequest:
        req = self.req if self.req.prompt_ids is not None else replace(self.req, prompt_ids=self.prompt_ids)
        return req.continuation(list(self.new_ids), self.first_token_at)


def _rollback(cache: DynamicCache, length: int) -> None:
    """Undo a failed step: the layers that ran before the error already appended to the cache,
    the later ones did not, so each layer is cut back to ``length`` on its own."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


class DecodeRun:
    """Runs one batch step by step; ``step()`` until ``done``. Raises KVCacheOutOfMemory only
    under split recovery."""

    def __init__(self, model, tokenizer, device: torch.device, delta_bytes: int, kv_capacity: int | None,
                 requests: Sequence[ProfiledRequest], *, elastic: bool = True,
                 recovery: Literal["preempt", "split"] = "preempt", max_preemptions: int = 8,
                 emulate: bool = False, prompt_ids: Sequence[list[int]],
                 clock: Callable[[], float] = time.time) -> None:
        self.model, self.tok, self.device = model, tokenizer, device
        self.delta, self.capacity = delta_bytes, kv_capacity
        self.elastic, self.recovery, self.max_preemptions = elastic, recovery, max_preemptions
        self.clock = clock
        self.eos = tokenizer.eos_token_id
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos
        # prompt ids come from LLMEngine.prompt_ids (the one tokenization rule, the gateway's count)
        self.rows = [_Row(r, list(p), tokenizer, emulate) for r, p in zip(requests, prompt_ids, strict=True)]
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.cache_len = 0
        self.input_len = 0
        self.steps = 0
        self.peak_kv_bytes = 0
        self.generated = 0  # tokens this run generated (the worker adds them to cohort_generated_tokens_total)
        self._held: list[tuple[_Row, RowResult]] = []  # static execution: answers wait for the batch's end
        self._cancelled: set[str] = set()

    @property
    def done(self) -> bool:
        return self.steps > 0 and not any(r.done is None for r in self.rows)

    def alive_ids(self) -> list[str]:
        return [r.req.id for r in self.rows if r.done is None]

    def cancel(self, request_ids: Iterable[str]) -> None:
        """Drop these rows at the next step (the client went away): nothing more is generated."""
        self._cancelled.update(request_ids)

    # --- memory ---------------------------------------------------------------------------
    def _fits(self, rows: int, cache_len: int) -> bool:
        return self.capacity is None or next_step_kv_tokens(rows, cache_len) * self.delta <= self.capacity

    def _make_room(self, out: StepOutput, cache_len: int) -> None:
        """Evict rows (preempt) until the next step fits, or raise (split). Under static
        execution finished rows still hold their KV rows, so they count too."""
        while not self._fits(len(self.rows), cache_len):
            self._shed_one(out, f"the next step needs {next_step_kv_tokens(len(self.rows), cache_len) * self.delta}"
                           f" bytes of KV cache; the instance has {self.capacity}")

    def _shed_one(self, out: StepOutput, why: str) -> None:
        """Free memory for one more step: finished rows first (static execution keeps them),
        then evict the row ``eviction_order`` names; a row alone that still does not fit fails."""
        if self.recovery == "split":
            raise KVCacheOutOfMemory(why)
        finished = [i for i, r in enumerate(self.rows) if r.done is not None]
        if finished:
            self._drop(finished)
            return
        if len(self.rows) == 1:
            row = self.rows[0]
            out.failed.append((row.req, FailureCode.OUT_OF_MEMORY,
                               f"this request alone outgrows the instance's KV memory after {row.total_tokens} "
                               f"generated tokens ({why}); lower max_tokens or shorten the input"))
            row.done = RowResult(row.req, "", row.total_tokens, FinishReason.LENGTH, row.first_token_at,
                                 self.clock())
            self._drop([0])
            return
        order = eviction_order([r.predicted_remaining for r in self.rows],
                               [r.req.preemptions for r in self.rows], self.max_preemptions)
        row = self.rows[order[0]]
        self._flush(row, out)
        self._send_scores(row, out)
        out.evicted.append(row.continuation())
        row.done = RowResult(row.req, "", row.total_tokens, FinishReason.LENGTH, row.first_token_at, self.clock())
        self._drop([order[0]])

    def _drop(self, indices: Sequence[int]) -> None:
        """Remove rows from the batch and their KV rows from the cache."""
        gone = set(indices)
        keep = [i for i in range(len(self.rows)) if i not in gone]
        self.rows = [self.rows[i] for i in keep]
        if self.cache is not None and keep:
            idx = torch.tensor(keep, device=self.device)
            self.cache.batch_select_indices(idx)
            self.mask, self.pos, self.last = self.mask[idx], self.pos[idx], self.last[idx]
        elif not keep:
            self.cache = None

    # --- the loop -------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> StepOutput:
        """Prefill on the first call, then one decode step. Every row that finishes, fails, is
        cancelled or evicted is in the output; ``done`` tells when nothing is left."""
        out = StepOutput()
        self._drop_cancelled()
        if not self.rows:
            self.steps = max(self.steps, 1)
            return self._release(out)
        if self.steps == 0:
            logits = self._prefill(out)
        else:
            logits = self._decode(out)
        if logits is not None:
            self._accept(logits, out)
        self.steps += 1
        if self.elastic:
            self._drop([i for i, r in enumerate(self.rows) if r.done is not None])
        return self._release(out)

    def _drop_cancelled(self) -> None:
        if self._cancelled:
            self._drop([i for i, r in enumerate(self.rows) if r.req.id in self._cancelled])

    def _prefill(self, out: StepOutput) -> torch.Tensor | None:
        while True:
            seqs = [r.all_ids for r in self.rows]
            L = max(len(s) for s in seqs)
            if self._fits(len(seqs), L - 1):
                break
            self._shed_one(out, f"the prefill of β={len(seqs)}, L={L} exceeds the KV memory")
            if not self.rows:
                return None
        ids = torch.full((len(seqs), L), self.pad, dtype=torch.long)
        mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            if s:
                ids[i, L - len(s):] = torch.tensor(s)
                mask[i, L - len(s):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)
        self.input_len = L
        scored = any(r.prompt_top is not None for r in self.rows)  # every position's logits, only then
        while True:
            self.cache = DynamicCache()
            try:
                res = self.model(input_ids=ids, attention_mask=mask, position_ids=pos,
                                 past_key_values=self.cache, use_cache=True, logits_to_keep=0 if scored else 1)
                break
            except torch.cuda.OutOfMemoryError as e:
                self.cache = None
                torch.cuda.empty_cache()
                keep = self._oom_evict(out, str(e))
                if not self.rows:
                    return None
                ids, mask, pos = ids[keep], mask[keep], pos[keep]
        self.mask, self.pos, self.cache_len = mask, pos[:, -1], L
        self._note_memory()
        if scored:
            for i, row in enumerate(self.rows):
                if row.prompt_top is not None:
                    seq = row.all_ids
                    scores = prompt_logprobs(res.logits[i, L - len(seq):L - 1], seq, row.prompt_top)
                    out.prompt_scores.append((row.req, seq, scores))
                    row.prompt_top = None
        return res.logits[:, -1, :]

    def _oom_evict(self, out: StepOutput, why: str) -> list[int]:
        """CUDA ran out inside a step: shed one row; the indices of the rows that stay."""
        before = list(self.rows)
        self._shed_one(out, f"CUDA out of memory: {why}")
        return [i for i, r in enumerate(before) if r in self.rows]

    def _decode(self, out: StepOutput) -> torch.Tensor | None:
        self._make_room(out, self.cache_len)
        if not self.rows:
            return None
        while True:
            mask = torch.cat([self.mask, self.mask.new_ones((len(self.rows), 1))], dim=1)
            pos = self.pos + 1
            try:
                res = self.model(input_ids=self.last[:, None], attention_mask=mask, position_ids=pos[:, None],
                                 past_key_values=self.cache, use_cache=True)
                break
            except torch.cuda.OutOfMemoryError as e:
                _rollback(self.cache, self.cache_len)
                torch.cuda.empty_cache()
                self._oom_evict(out, str(e))
                if not self.rows:
                    return None
        self.mask, self.pos = mask, pos
        self.cache_len += 1
        self._note_memory()
        return res.logits[:, -1, :]

    def _note_memory(self) -> None:
        if self.device.type == "cuda":
            self.peak_kv_bytes = max(self.peak_kv_bytes, int(torch.cuda.max_memory_allocated(self.device)))
        else:
            self.peak_kv_bytes = max(self.peak_kv_bytes, len(self.rows) * self.cache_len * self.delta)

    def _accept(self, logits: torch.Tensor, out: StepOutput) -> None:
        """Choose each alive row's next token and apply its stop rules."""
        scores = logits.float()
        live = [i for i, r in enumerate(self.rows) if r.done is None]
        hold = [i for i in live if self.rows[i].req.sampling.ignore_eos or (
            self.rows[i].emulated is not None and len(self.rows[i].new_ids) + 1 < self.rows[i].limit)]
        if hold and self.eos is not None:
            scores[hold, self.eos] = float("-inf")  # an emulated length / ignore_eos never sees EOS
        greedy = scores.argmax(dim=-1).tolist()
        tokens = [self.pad] * len(self.rows)
        now = self.clock()
        for i in live:
            row = self.rows[i]
            if row.sampler.plain_greedy:
                tok, processed = greedy[i], scores[i:i + 1]
            else:
                seq = torch.tensor([row.all_ids], device=scores.device)
                processed = row.sampler.process(seq, scores[i:i + 1])
                tok = row.sampler.choose(processed, row.total_tokens)
            tokens[i] = tok
            scored = None if row.top_logprobs is None else token_logprob(processed, tok, row.top_logprobs)
            self._advance(row, tok, now, out, scored)
        self.last = torch.tensor(tokens, device=self.device)

    def _advance(self, row: _Row, tok: int, now: float, out: StepOutput,
                 scored: TokenLogprob | None = None) -> None:
        if row.limit == 0:
            self._finish(row, FinishReason.LENGTH, now, out)
            return
        if tok == self.eos and row.emulated is None:
            self._finish(row, FinishReason.STOP, now, out)
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
                    self._finish(row, FinishReason.STOP, now, out, text=text[:cut])
                    return
        if len(row.new_ids) >= row.limit:
            reason = FinishReason.LENGTH if len(row.new_ids) >= row.req.max_tokens else FinishReason.STOP
            self._finish(row, reason, now, out)
            return
        keep = row.max_stop - 1 if row.max_stop else 0
        self._send(row, len(row.pending) - keep, out)

    def _send(self, row: _Row, n: int, out: StepOutput) -> None:
        """Stream the first ``n`` pending characters with every token id not yet streamed (a
        delta may carry ids and no text: held-back text still records the tokens)."""
        if not self.elastic:
            return
        text = row.pending[:max(0, n)]
        if not text and not row.unsent_ids:
            return
        out.deltas.append((row.req, text, row.total_tokens, self._take_ids(row)))
        row.sent += len(text)
        row.pending = row.pending[len(text):]

    @staticmethod
    def _take_ids(row: _Row) -> list[int]:
        """The row's unsent ids (with their logprobs when it asked for them), now sent."""
        ids = row.unsent_ids if row.top_logprobs is None else ScoredIds(row.unsent_ids, row.unsent_logprobs)
        row.unsent_ids, row.unsent_logprobs = [], []
        return ids

    def _send_scores(self, row: _Row, out: StepOutput) -> None:
        """Static execution streams nothing, but logprobs have no other way to the client: the
        row's unsent ids and logprobs go out in one delta without text (the end event has it)."""
        if not self.elastic and row.top_logprobs is not None and row.unsent_ids:
            out.deltas.append((row.req, "", row.total_tokens, self._take_ids(row)))

    def _flush(self, row: _Row, out: StepOutput) -> None:
        self._send(row, len(row.pending), out)

    def _finish(self, row: _Row, reason: FinishReason, now: float, out: StepOutput, text: str | None = None) -> None:
        self._flush(row, out)
        full = row.detok.text() if text is None else text
        row.done = RowResult(row.req, full, row.total_tokens, reason, row.first_token_at, now)
        if self.elastic:
            out.finished.append(row.done)
        else:
            self._held.append((row, row.done))

    def _release(self, out: StepOutput) -> StepOutput:
        """Static execution answers everyone when the batch ends: that is when each client gets
        its first (and last) text, so both times are the release time."""
        if not self.elastic and self.done and self._held:
            now = self.clock()
            for row, res in self._held:
                self._send_scores(row, out)
                out.finished.append(replace(res, first_token_at=now, finished_at=now))
            self._held = []
        return out

    def run_to_end(self) -> list[StepOutput]:
        """Every step's output (profiling, tests)."""
        outs = []
        while not self.done:
            outs.append(self.step())
        return outs
