"""AdaptiveLLM's cost-aware preemption decision (Algorithm 1, eq. 2–4): swap a victim's KV to the
host pool or drop it and recompute it later — one pure rule for the simulator and the worker.

Why a separate module: the choice depends only on two predicted costs and the host pool's room,
so it is written once here (no torch, no Redis) and both worlds import it; the costs come from
whoever knows them (the simulator's roofline, the worker's measured link and fitted prefill model).

* swap time = bytes ÷ bandwidth out to the host plus bytes ÷ bandwidth back in (eq. 2), with
  bytes = tokens · Δ and Δ = 2 · layers · kv_heads · head_dim · dtype_bytes (eq. 3–4 with the
  KV heads, not hidden_size: grouped-query models keep fewer K/V heads than attention heads).
  Whole 16-token pages move, so the caller passes the tokens its pages hold.
* recompute time = the prefill of prompt + generated tokens; where the row is re-prefilled
  inside a batch, the caller passes the marginal cost f(β+1, L) − f(β, L) instead.
* Victims are taken lowest priority first (the prose of Algorithm 1; its pseudocode's pop()
  would take the highest): the caller orders them, this module only decides swap or recompute.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from cohort.settings import PreemptionMode

PREEMPTION_MODES: tuple[PreemptionMode, ...] = ("recompute", "swap", "adaptive")


@dataclass(frozen=True)
class SwapLink:
    """Host↔device bandwidth, bytes/s each way (measured at start on CUDA, a preset in the simulator)."""

    to_host_bytes_per_s: float
    to_device_bytes_per_s: float


def swap_seconds(tokens: int, kv_bytes_per_token: int, link: SwapLink) -> float:
    """Time to move ``tokens`` of KV out to the host and back in (eq. 2): bytes/DtoH + bytes/HtoD."""
    nbytes = float(tokens) * float(kv_bytes_per_token)
    return nbytes / link.to_host_bytes_per_s + nbytes / link.to_device_bytes_per_s


def choose_preemption(mode: PreemptionMode, swap_s: float, recompute_s: float,
                      host_free_tokens: int, tokens: int) -> Literal["swap", "recompute"]:
    """Swap or recompute one victim holding ``tokens`` of KV.

    ``recompute`` always recomputes; ``swap`` swaps whenever the host pool has room (a victim
    that does not fit there can only be recomputed); ``adaptive`` swaps only when it is also
    predicted cheaper (Algorithm 1, line 6: swap_time < recomp_time ∧ kv ≤ free host memory).
    """
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption mode must be one of {PREEMPTION_MODES}, got {mode!r}")
    room = tokens <= host_free_tokens
    if mode == "swap":
        return "swap" if room else "recompute"
    if mode == "adaptive" and room and swap_s < recompute_s:
        return "swap"
    return "recompute"
