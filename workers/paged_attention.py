"""Paged KV attention on the model's own forward, through transformers' public
``AttentionInterface``: no subclassing of their continuous-batching internals.

KV lives in a preallocated page store (``PageStore``: per layer, ``[pages, page_size, kv_heads,
head_dim]``), so a step writes its new keys/values into their slots instead of re-allocating a
cache with ``torch.cat``. One forward takes a *packed* sequence (batch 1): prefill chunks of the
joining rows and one token per decoding row, each with its own position ids; the registered
attention function writes the step's K/V into the store and attends each row only to its own
context (SDPA per row, causal within the row's new tokens). The running set (``batcher.running_set``)
owns which pages each row holds; this module only reads the slot lists it is handed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from workers.decode_lanes import DecodeLanes, LaneStep

PAGED_ATTENTION = "cohort_paged"


class PageStore:
    """The preallocated KV pool: one key and one value tensor per layer, addressed by flat slot
    (page · page_size + offset)."""

    def __init__(self, layers: int, num_pages: int, page_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        shape = (num_pages * page_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.page_size = page_size


@dataclass
class DecodeBatch:
    """The step's decoding rows (one new token each), attended in one batched SDPA call: their
    contexts' slots padded to the longest (``valid`` masks the padding). On a CPU one call for
    every decoding row beats a call per row; only the attention reads the padding."""

    query_at: torch.Tensor  # [R] each row's token in the packed sequence
    slots: torch.Tensor | None = None     # [R, C] context slots, padded (gathered from the pages)
    valid: torch.Tensor | None = None     # [R, C] True where a slot is the row's own context
    lanes: DecodeLanes | None = None      # or: the rows' contiguous lanes (CPU, no gather)
    lane_step: LaneStep | None = None


@dataclass
class PackedStep:
    """One forward's layout: for each prefill row, where its new tokens sit in the packed sequence
    and the slots of its whole context (old + new, in position order); the decoding rows together."""

    store: PageStore
    write_slots: torch.Tensor  # [tokens] slot of each packed token's K/V
    rows: list[tuple[int, int, torch.Tensor]]  # (start in packed seq, new tokens, context slots)
    decode: DecodeBatch | None = None


def context_slots(block_table: torch.Tensor, length: int, page_size: int) -> torch.Tensor:
    """Flat slots of positions [0, length) of a row whose pages are ``block_table`` (a tensor)."""
    offsets = torch.arange(page_size, device=block_table.device)
    return (block_table[:, None] * page_size + offsets).flatten()[:length]


def slots_for(block_table: list[int], start: int, end: int, page_size: int) -> list[int]:
    """Flat slots of positions [start, end) of a row whose pages are ``block_table``."""
    return [block_table[p // page_size] * page_size + p % page_size for p in range(start, end)]


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                    cohort_step: PackedStep | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """query/key/value: [1, heads, tokens, head_dim] over the packed step; returns [1, tokens, heads, dim]."""
    if cohort_step is None:  # an ordinary forward (padded decode, generate, profiling): plain SDPA
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    layer, store = module.layer_idx, cohort_step.store
    store.k[layer][cohort_step.write_slots] = key[0].transpose(0, 1).to(store.k[layer].dtype)
    store.v[layer][cohort_step.write_slots] = value[0].transpose(0, 1).to(store.v[layer].dtype)
    out = torch.empty_like(query[0].transpose(0, 1))  # [tokens, heads, dim]
    dec = cohort_step.decode
    if dec is not None and dec.lanes is not None:
        at = dec.query_at
        out[at] = dec.lanes.attend(layer, query[0][:, at].transpose(0, 1), key[0][:, at].transpose(0, 1),
                                   value[0][:, at].transpose(0, 1), dec.lane_step, scaling)
    elif dec is not None:
        q = query[0][:, dec.query_at].transpose(0, 1).unsqueeze(2)  # [R, heads, 1, dim]
        k = store.k[layer][dec.slots].transpose(1, 2).to(q.dtype)  # [R, kv_heads, C, dim]
        v = store.v[layer][dec.slots].transpose(1, 2).to(q.dtype)
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dec.valid[:, None, None, :], scale=scaling, enable_gqa=k.shape[1] != q.shape[1])
        out[dec.query_at] = o[:, :, 0]
    for start, n, ctx in cohort_step.rows:
        q = query[0, :, start:start + n]  # [heads, n, dim]
        # index_select: half the CPU time of advanced indexing for the same gather
        k = store.k[layer].index_select(0, ctx).transpose(0, 1).to(q.dtype)  # [kv_heads, ctx, dim]
        v = store.v[layer].index_select(0, ctx).transpose(0, 1).to(q.dtype)
        c = k.shape[1]
        # query i sits at context position c - n + i and sees keys 0 .. c - n + i
        mask = None
        if n > 1:
            qpos = torch.arange(c - n, c, device=q.device)[:, None]
            mask = torch.arange(c, device=q.device)[None, :] <= qpos
        o = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scaling, enable_gqa=k.shape[0] != q.shape[0])
        out[start:start + n] = o.transpose(0, 1)
    return out.unsqueeze(0), None


_PACKED = ContextVar("cohort_packed_step", default=False)


@contextmanager
def packed_forward() -> Iterator[None]:
    """Around a packed step's forward: the model builds no mask (each row's causal mask is built
    in ``paged_attention``; a packed sequence's full mask would cost tokens² memory for nothing)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _paged_mask(*args, **kwargs):
    """SDPA's mask for an ordinary forward of the model, none inside a packed step."""
    return None if _PACKED.get() else sdpa_mask(*args, **kwargs)


def register_paged_attention() -> str:
    """Register the attention function once; returns its name. Outside a packed step it is plain
    SDPA with SDPA's mask, so any other forward of the same model (a padded batch, ``generate``)
    still works: the model serves both paths."""
    AttentionInterface.register(PAGED_ATTENTION, paged_attention)
    AttentionMaskInterface.register(PAGED_ATTENTION, _paged_mask)
    return PAGED_ATTENTION
