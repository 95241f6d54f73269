"""Running one static batch with HF ``generate``: left padding, greedy by default, per-request
length limits, emulated lengths, and the OOM path (CUDA OOM, or a KV budget on the CPU).

A static batch runs until its longest member is done; shorter members are held to their own
limit by forcing EOS at that step (that is how ``max_tokens`` works per request here).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import LogitsProcessor, LogitsProcessorList

from batcher.memory import kv_bytes_per_token
from cohort.settings import Settings
from cohort.tokenizer import uses_special_tokens
from cohort.types import SamplingParams
from workers.model import load_model

log = logging.getLogger(__name__)


class KVCacheOutOfMemory(RuntimeError):
    """The batch's KV cache outgrew the instance's memory (CUDA OOM or the CPU KV budget)."""


@dataclass
class RowSpec:
    """One request as the engine sees it."""

    prompt: str
    max_tokens: int
    emulated_tokens: int | None = None

    @property
    def stop_at(self) -> int:
        """Tokens this row generates at most: its emulated length (capped by max_tokens) or max_tokens."""
        if self.emulated_tokens is not None:
            return max(0, min(self.emulated_tokens, self.max_tokens))
        return self.max_tokens


@dataclass
class BatchOutput:
    texts: list[str]
    generated_tokens: list[int]
    input_len: int            # L(B) as padded
    gen_len: int              # G(B): decoding steps the batch ran
    seconds: float
    peak_mem_bytes: int


class RowLimits(LogitsProcessor):
    """Per-row length control inside one ``generate`` call.

    Rows with an emulated length never see EOS before it and are forced to EOS at it (mirrors
    ``ignore_eos`` in vLLM's benchmark client). Every row is forced to EOS at its own max_tokens.
    It also enforces the CPU KV budget: the cache holds β·(L(B)+t) tokens at step t.
    """

    def __init__(self, prompt_len: int, stops: Sequence[int], emulated: Sequence[bool], eos_id: int,
                 delta_bytes: int, kv_budget: int | None) -> None:
        self.prompt_len = prompt_len
        self.stops = torch.tensor(list(stops))
        self.emulated = torch.tensor(list(emulated), dtype=torch.bool)
        self.eos = eos_id
        self.delta = delta_bytes
        self.budget = kv_budget

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        step = input_ids.shape[1] - self.prompt_len
        if self.budget is not None:
            need = input_ids.shape[0] * (input_ids.shape[1] + 1) * self.delta
            if need > self.budget:
                raise KVCacheOutOfMemory(
                    f"KV cache needs {need} bytes at step {step} (β={input_ids.shape[0]}, "
                    f"L+t={input_ids.shape[1] + 1}), budget {self.budget}")
        stops = self.stops.to(scores.device)
        emulated = self.emulated.to(scores.device)
        hold = emulated & (step < stops)
        if hold.any():
            scores[hold, self.eos] = float("-inf")
        force = step >= stops
        if force.any():
            scores[force] = float("-inf")
            scores[force, self.eos] = 0.0
        return scores


class Engine:
    """One LLM instance: the model, its tokenizer, Δ and Θ."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model, self.tokenizer, self.device = load_model(settings)
        cfg = self.model.config.to_dict()
        dtype_bytes = torch.finfo(next(self.model.parameters()).dtype).bits // 8
        self.delta_bytes = kv_bytes_per_token(cfg, dtype_bytes)
        self.theta_bytes = settings.theta_override_bytes or self._measure_theta()
        self._special = uses_special_tokens(settings.model)

    def _measure_theta(self) -> int:
        """Θ: device memory left for the KV cache after weights and an activation reserve."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return int(max(0, free - self.settings.activation_reserve_frac * total))
        return int(self.settings.kv_budget_bytes)

    @property
    def kv_budget(self) -> int | None:
        """Enforced on the CPU only; on CUDA the allocator itself says when memory runs out."""
        return None if self.device.type == "cuda" else int(self.settings.kv_budget_bytes)

    def fits(self, size: int, input_len: int, gen_len: int) -> bool:
        """Whether a batch of this shape fits the KV memory this instance really has."""
        cap = min(self.theta_bytes, self.kv_budget) if self.kv_budget is not None else self.theta_bytes
        return size * (input_len + gen_len + 1) * self.delta_bytes <= cap

    def count_tokens(self, texts: Sequence[str]) -> list[int]:
        ids = self.tokenizer(list(texts), add_special_tokens=self._special)["input_ids"]
        return [len(x) for x in ids]

    @torch.inference_mode()
    def run(self, rows: Sequence[RowSpec], sampling: SamplingParams | None = None) -> BatchOutput:
        """Generate for the whole batch in one ``generate`` call; raises KVCacheOutOfMemory."""
        enc = self.tokenizer([r.prompt for r in rows], return_tensors="pt", padding=True,
                             add_special_tokens=self._special)
        return self._run_ids(enc["input_ids"], enc["attention_mask"], rows, sampling or SamplingParams())

    def _run_ids(self, input_ids: torch.Tensor, attention: torch.Tensor, rows: Sequence[RowSpec],
                 sampling: SamplingParams) -> BatchOutput:
        """``run`` on an already tokenized, left-padded batch."""
        tok = self.tokenizer
        input_ids, attention = input_ids.to(self.device), attention.to(self.device)
        prompt_len = input_ids.shape[1]
        stops = [r.stop_at for r in rows]
        max_new = max(stops)
        if self.kv_budget is not None and len(rows) * prompt_len * self.delta_bytes > self.kv_budget:
            raise KVCacheOutOfMemory(f"prefill of β={len(rows)}, L={prompt_len} exceeds the KV budget")
        limits = RowLimits(prompt_len, stops, [r.emulated_tokens is not None for r in rows],
                           tok.eos_token_id, self.delta_bytes, self.kv_budget)
        gen_kwargs = dict(max_new_tokens=max_new, min_new_tokens=0, do_sample=not sampling.greedy,
                          pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                          logits_processor=LogitsProcessorList([limits]))
        if not sampling.greedy:
            gen_kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p)
            if sampling.seed is not None:
                torch.manual_seed(sampling.seed)
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        try:
            if max_new == 0:
                out = input_ids
            else:
                out = self.model.generate(input_ids=input_ids, attention_mask=attention, **gen_kwargs)
        except torch.cuda.OutOfMemoryError as e:
            torch.cuda.empty_cache()
            raise KVCacheOutOfMemory(str(e)) from e
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = time.perf_counter() - t0
        gen = out[:, prompt_len:].cpu()
        texts, counts = [], []
        for i, row in enumerate(gen.tolist()):
            n = row.index(tok.eos_token_id) if tok.eos_token_id in row else len(row)
            n = min(n, stops[i])
            counts.append(n)
            texts.append(tok.decode(row[:n], skip_special_tokens=True))
        if self.device.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(self.device))
        else:
            peak = len(rows) * (prompt_len + gen.shape[1]) * self.delta_bytes
        return BatchOutput(texts, counts, prompt_len, int(gen.shape[1]), seconds, peak)

    def run_shape(self, size: int, input_len: int, gen_len: int) -> float:
        """Wall seconds for a batch of ``size`` prompts of ``input_len`` tokens generating exactly
        ``gen_len`` tokens each (profiling the batch-time model)."""
        ids = torch.arange(1000, 1000 + input_len).remainder(len(self.tokenizer)).repeat(size, 1)
        rows = [RowSpec("", gen_len, gen_len) for _ in range(size)]
        return self._run_ids(ids, torch.ones_like(ids), rows, SamplingParams()).seconds
