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
from typing import Literal

import torch
from transformers import DynamicCache

from batcher.elastic import eviction_order, next_step_kv_tokens
from batcher.memory import KVMemory
from cohort.protocol import FailureCode, FinishReason
from cohort.types import ProfiledRequest
from workers.prompt_logprobs import prompt_logprobs
from workers.row_text import TextStage
from workers.rows import RowState, TokenStepper
from workers.step_outputs import KVCacheOutOfMemory, StepOutput


def _rollback(cache: DynamicCache, length: int) -> None:
    """Undo a failed step: the layers that ran before the error already appended to the cache,
    the later ones did not, so each layer is cut back to ``length`` on its own."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


class PaddedRun:
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
        self.text = TextStage(tokenizer, streaming=elastic, clock=clock)
        self.stepper = TokenStepper(tokenizer, text=self.text, clock=clock)
        self.pad = self.stepper.pad
        # prompt ids come from LLMEngine.prompt_ids (the one tokenization rule, the gateway's count)
        self.rows = [RowState(r, list(p), emulate) for r, p in zip(requests, prompt_ids, strict=True)]
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None
        self.pos: torch.Tensor | None = None
        self.last: torch.Tensor | None = None
        self.cache_len = 0
        self.input_len = 0
        self.steps = 0
        self.peak_kv_bytes = 0
        self._cancelled: set[str] = set()

    @property
    def generated(self) -> int:
        """Tokens this run generated (the worker adds them to cohort_generated_tokens_total)."""
        return self.stepper.generated

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
        return self.capacity is None or KVMemory(self.delta, self.capacity).judge().next_step_fits(rows, cache_len)

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
            row.done = FinishReason.LENGTH
            self.text.forget(row.req.id)
            self._drop([0])
            return
        order = eviction_order([r.predicted_remaining for r in self.rows],
                               [r.req.preemptions for r in self.rows], self.max_preemptions)
        self.stepper.evict(self.rows[order[0]], out)
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
        """Choose each alive row's next token and apply its stop rules (``workers.rows``)."""
        self.last = torch.tensor(self.stepper.accept(self.rows, logits, out), device=self.device)

    def _release(self, out: StepOutput) -> StepOutput:
        """Static execution answers everyone when the batch ends."""
        if self.done:
            self.text.release(out)
        return out

    def run_to_end(self) -> list[StepOutput]:
        """Every step's output (profiling, tests)."""
        outs = []
        while not self.done:
            outs.append(self.step())
        return outs
