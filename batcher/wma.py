"""Wasted memory access (Magnus): KV reads that contribute nothing to any output.

WMA_gen(p)  = G(p) · (L(B) − L(p))                 padding read while p still generates
WMA_wait(p) = Σ_{g=G(p)+1}^{G(B)} (g + L(B))         reads after p's EOS while the batch runs on
WMA(B)      = max_p (WMA_gen(p) + WMA_wait(p))
The sum starts at G(p)+1 (SPEC), so a batch of one wastes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence


def wma_gen(input_len: int, gen_len: int, batch_input_len: int) -> int:
    return gen_len * (batch_input_len - input_len)


def wma_wait(gen_len: int, batch_gen_len: int, batch_input_len: int) -> int:
    """Closed form of Σ_{g=G(p)+1}^{G(B)} (g + L(B))."""
    n = batch_gen_len - gen_len
    if n <= 0:
        return 0
    return n * batch_input_len + (batch_gen_len * (batch_gen_len + 1) - gen_len * (gen_len + 1)) // 2


def member_wma(lengths: Sequence[tuple[int, int]]) -> list[int]:
    """WMA_gen(p) + WMA_wait(p) for every member of a batch given as (L(p), G(p)) pairs."""
    if not lengths:
        return []
    L_B = max(L for L, _ in lengths)
    G_B = max(G for _, G in lengths)
    return [wma_gen(L, G, L_B) + wma_wait(G, G_B, L_B) for L, G in lengths]


def batch_wma(lengths: Sequence[tuple[int, int]]) -> int:
    """WMA(B) = max over members."""
    return max(member_wma(lengths), default=0)


def total_wma(lengths: Sequence[tuple[int, int]]) -> int:
    """Σ over members: every wasted read in the batch (a benchmark metric)."""
    return sum(member_wma(lengths))
