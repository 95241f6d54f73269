"""One LLM instance: the loaded model, its tokenizer, Δ (KV bytes per token) and Θ (KV memory).

``start`` hands a batch to the padded decode loop (workers.padded_run.PaddedRun) and
``continuous_run`` makes the continuous engine's run (workers.continuous); the worker drives them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from batcher.memory import KVMemory, kv_bytes_per_token
from batcher.prefix_pages import page_salt
from batcher.row_priority import StepShares
from cohort.settings import Settings
from cohort.tokenizer import uses_special_tokens
from cohort.types import ProfiledRequest
from workers.continuous import ContinuousRun, SwapPlan
from workers.model import load_model
from workers.padded_run import PaddedRun
from workers.step_outputs import KVCacheOutOfMemory
from workers.swap_pool import HostSwapPool, measure_link

if TYPE_CHECKING:
    from predictor.recompute_cost import FittedRecomputeCost

__all__ = ["PaddedRun", "LLMEngine", "KVCacheOutOfMemory"]

log = logging.getLogger(__name__)


class LLMEngine:
    """One LLM instance: the model, its tokenizer, Δ and Θ."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.model, self.tokenizer, self.device = load_model(settings)
        cfg = self.model.config.to_dict()
        self.max_model_len = int(cfg.get("max_position_embeddings") or 0)  # its context (0: not bounded)
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
        """KV bytes the decode loop enforces before each step: on the CPU only; on CUDA the
        allocator itself says when memory runs out (a step's OutOfMemoryError)."""
        return None if self.device.type == "cuda" else int(self.settings.kv_budget_bytes)

    @property
    def memory(self) -> KVMemory:
        """The KV memory this instance really has: Θ, and on a CPU no more than the KV budget its
        decode loop enforces. It advertises Θ (the gateway checks requests against it): the same
        unless COHORT_THETA_OVERRIDE_BYTES advertises more on purpose (the OOM drills)."""
        cap = min(self.theta_bytes, self.kv_budget) if self.kv_budget is not None else self.theta_bytes
        return KVMemory(self.delta_bytes, cap)

    def fits(self, size: int, input_len: int, gen_len: int) -> bool:
        """Whether a batch of this shape fits the KV memory this instance really has."""
        return self.memory.judge().fits(size, input_len, gen_len)

    def prompt_ids(self, prompt: str) -> list[int]:
        """A prompt's token ids exactly as the gateway counted them (cohort.tokenizer)."""
        return self.tokenizer(prompt, add_special_tokens=self._special)["input_ids"]

    def request_prompt_ids(self, req: ProfiledRequest) -> list[int]:
        """The ids a request's prompt runs as: a continuation brings its own."""
        return list(req.prompt_ids) if req.prompt_ids is not None else self.prompt_ids(req.prompt)

    @property
    def kv_capacity_tokens(self) -> int:
        """KV tokens this instance holds: Θ (CUDA: free memory after the weights, less the
        activation reserve; CPU: the KV budget) over Δ — the page pool's size under continuous
        execution, computed once at start as nano-vllm's ``allocate_kv_cache`` does."""
        return self.memory.theta_tokens

    def marginal_cost(self) -> float:
        """COHORT_CONTINUOUS__MARGINAL_COST where this worker can price a row: on a CUDA device its
        steps are timed after their kernels (the device's own time). A CPU worker shares its cores
        with the gateway, the batcher and Redis, so its step times measure them too: fitted in the
        e2e suite they priced a tiny-model row at 0.5 ms (0.09 ms alone) and would have capped the
        running set at 4-8 rows; alone on an idle CPU the rule binds only past ~118 rows, beyond
        the 64 groups a worker runs. So a CPU worker does not apply it (logged at start)."""
        limit = self.settings.continuous.marginal_cost
        if limit and self.device.type != "cuda":
            log.info("continuous: the marginal-cost row rule (COHORT_CONTINUOUS__MARGINAL_COST=%g) is off on a "
                     "%s device: its step times measure the other processes on its cores too", limit, self.device.type)
            return 0.0
        return limit

    def continuous_run(self) -> ContinuousRun:
        """A fresh continuous run over a page pool of ``kv_capacity_tokens``."""
        s = self.settings
        return ContinuousRun(self.model, self.tokenizer, self.device, self.dtype,
                             num_pages=max(1, self.kv_capacity_tokens // s.continuous.page_tokens),
                             page_size=s.continuous.page_tokens, token_budget=s.continuous.step_token_budget,
                             max_preemptions=s.max_preemptions, emulate=s.emulate_lengths, swap=self.swap_plan(),
                             max_rows=s.continuous.max_rows, marginal_cost=self.marginal_cost(),
                             shares=StepShares(span=s.offline.priority, slowdown=s.continuous.background_slowdown,
                                               min_duty=s.continuous.background_min_duty),
                             prefix_salt=page_salt(s.model) if s.prefix_caching else None)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def swap_plan(self) -> SwapPlan | None:
        """What swapping costs on this instance (``COHORT_PREEMPTION`` swap or adaptive): the host
        pool, the link measured both ways, and a recompute's cost per token measured on the model.
        None under recompute, or with no host pool."""
        s = self.settings
        if s.preemption == "recompute":
            return None
        nbytes = s.swap_bytes if s.swap_bytes is not None else (4 << 30 if self.device.type == "cuda" else 0)
        if nbytes < self.delta_bytes:
            log.warning("COHORT_PREEMPTION=%s but no host swap pool (COHORT_SWAP_BYTES): every eviction "
                        "recomputes", s.preemption)
            return None
        if not hasattr(self, "_swap_costs"):
            self._swap_costs = (measure_link(self.device, self.dtype), self._prefill_s_per_token())
            log.info("swap link %.2f GB/s out, %.2f GB/s in; recompute %.1f µs/token",
                     self._swap_costs[0].to_host_bytes_per_s / 1e9, self._swap_costs[0].to_device_bytes_per_s / 1e9,
                     self._swap_costs[1] * 1e6)
        link, per_token = self._swap_costs
        fitted = self.recompute_cost()
        return SwapPlan(s.preemption, HostSwapPool(nbytes // self.delta_bytes, pin=self.device.type == "cuda"),
                        link, self.delta_bytes, per_token,
                        recompute_cost=fitted.recompute_seconds if fitted is not None else None)

    def recompute_cost(self) -> FittedRecomputeCost | None:
        """The fitted recompute-cost model (AdaptiveLLM §3.2) profiled for this model on this
        device type, read once; None (the decision then uses the measured prefill rate) when
        there is none."""
        if not hasattr(self, "_fitted_cost"):
            from predictor.recompute_cost import load_cost_file  # scikit-learn: only where swapping is on

            path = self.settings.recompute_cost_file()
            self._fitted_cost = load_cost_file(path, self.settings.model, self.device.type)
            if self._fitted_cost is not None:
                log.info("recompute cost: %s degree %d from %s", self._fitted_cost.name, self._fitted_cost.degree,
                         path)
            else:
                log.info("recompute cost: no fitted model for %s on %s at %s; using the measured prefill rate",
                         self.settings.model, self.device.type, path)
        return self._fitted_cost

    @torch.inference_mode()
    def _prefill_s_per_token(self, tokens: int = 256) -> float:
        """A recompute's cost per token: the best of three plain prefills of ``tokens`` tokens."""
        ids = torch.full((1, tokens), 1000 % self.model.config.vocab_size, device=self.device)
        best = float("inf")
        for _ in range(3):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t = time.perf_counter()
            self.model(input_ids=ids, use_cache=False, logits_to_keep=1)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            best = min(best, time.perf_counter() - t)
        return best / tokens

    def start(self, requests: Sequence[ProfiledRequest], *, elastic: bool | None = None,
              recovery: str | None = None, emulate: bool | None = None,
              prompt_ids: Sequence[list[int]] | None = None) -> PaddedRun:
        """A decode loop over these requests (settings give the modes unless overridden)."""
        s = self.settings
        ids = prompt_ids if prompt_ids is not None else [self.request_prompt_ids(r) for r in requests]
        return PaddedRun(self.model, self.tokenizer, self.device, self.delta_bytes, self.kv_budget, requests,
                        elastic=(s.execution != "static") if elastic is None else elastic,
                        recovery=recovery or s.oom_recovery, max_preemptions=s.max_preemptions,
                        emulate=s.emulate_lengths if emulate is None else emulate, prompt_ids=ids)

    @torch.inference_mode()
    def run_shape(self, size: int, input_len: int, gen_len: int) -> float:
        """Wall seconds for a batch of ``size`` prompts of ``input_len`` tokens generating exactly
        ``gen_len`` tokens each (profiling the batch-time model)."""
        ids = [[1000 + (i % 5000) for i in range(input_len)] for _ in range(size)]
        reqs = [ProfiledRequest(id=f"profile-{k}", prompt="", input_tokens=input_len, predicted_tokens=gen_len,
                                max_tokens=gen_len, arrival=0.0, emulated_tokens=gen_len) for k in range(size)]
        run = self.start(reqs, elastic=True, recovery="split", emulate=True, prompt_ids=ids)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        run.run_to_end()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - t0
