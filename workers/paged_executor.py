"""The continuous engine's executor: tensors only. It runs one ``StepPlan``
from the row book as a single packed forward of the model over the page store and hands back,
per row, the logits of its last new position (the next-token distribution) — and, for prefill
chunks, every prompt position's logits to an optional hook (prompt logprobs, echo).

Sampling, stop strings and detokenizing stay with the caller: this class knows rows only by id,
their token ids and their block tables.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping, Sequence

import torch

from batcher.running_set import RunningSet, StepPlan
from workers.decode_lanes import DecodeLanes
from workers.paged_attention import (
    DecodeBatch,
    PackedStep,
    PageStore,
    context_slots,
    packed_forward,
    register_paged_attention,
    slots_for,
)

PromptHook = Callable[[str, int, torch.Tensor], None]  # (row id, first position, logits [n, vocab])


def packed_path_refusal(model) -> str | None:
    """Why this model cannot take the packed paged path (None when it can): the attention must be
    swappable through ``AttentionInterface`` and every attention layer must know its index."""
    if not getattr(model, "_supports_attention_backend", False):
        return f"{type(model).__name__} does not route attention through transformers' AttentionInterface"
    if not getattr(model.config, "num_hidden_layers", None):
        return f"{type(model).__name__}'s config names no num_hidden_layers"
    return None


class PagedExecutor:
    """Packed prefill + per-row decode for one model on a preallocated page store."""

    def __init__(self, model, book: RunningSet, dtype: torch.dtype, device: torch.device) -> None:
        cfg = model.config
        heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
        self.model, self.book, self.device = model, book, device
        self.store = PageStore(cfg.num_hidden_layers, book.pool.num_pages, book.page_size, kv_heads, head_dim,
                               dtype, device)
        model.set_attn_implementation(register_paged_attention())
        self._slots: dict[str, tuple[list[int], int, torch.Tensor]] = {}  # row -> (its pages, count, slots)
        # a CPU decodes on contiguous lanes (workers.decode_lanes); a CUDA pool gathers from its pages
        self.lanes = DecodeLanes(cfg.num_hidden_layers, kv_heads, head_dim, dtype, device) if (
            device.type == "cpu") else None

    def _row_slots(self, row_id: str, pages: list[int]) -> torch.Tensor:
        """Every slot of a row's pages, in position order: kept between steps (a row's page list
        only grows while it runs; a new list means it was admitted again) and extended by the
        pages it gained."""
        ps = self.book.page_size
        hit = self._slots.get(row_id)
        if hit is not None and hit[0] is pages and hit[1] == len(pages):
            return hit[2]
        if hit is not None and hit[0] is pages and hit[1] < len(pages):
            new = context_slots(torch.tensor(pages[hit[1]:], device=self.device), (len(pages) - hit[1]) * ps, ps)
            slots = torch.cat([hit[2], new])
        else:
            slots = context_slots(torch.tensor(pages, device=self.device), len(pages) * ps, ps)
        self._slots[row_id] = (pages, len(pages), slots)
        return slots

    def _decode_batch(self, query_at: torch.Tensor, ctxs: list[tuple[str, int, torch.Tensor]]) -> DecodeBatch:
        """The decoding rows' attention input: their lanes (CPU), or their contexts' slots padded
        to the longest (``ctxs``: row id, new token's position p, the row's slots)."""
        if self.lanes is not None:
            return DecodeBatch(query_at, lanes=self.lanes, lane_step=self.lanes.prepare(ctxs, self.store.k,
                                                                                        self.store.v))
        slots = torch.nn.utils.rnn.pad_sequence([s[:p + 1] for _r, p, s in ctxs], batch_first=True)
        lens = torch.tensor([p + 1 for _r, p, _s in ctxs], device=self.device)
        valid = torch.arange(slots.shape[1], device=self.device)[None, :] < lens[:, None]
        return DecodeBatch(query_at, slots, valid)

    @torch.inference_mode()
    def run(self, plan: StepPlan, tokens: Mapping[str, Sequence[int]], prompt_hook: PromptHook | None = None,
            hook_rows: Container[str] | None = None) -> dict[str, torch.Tensor]:
        """``tokens[row]`` is the row's whole id list (prompt + generated); returns row → last logits.
        The hook sees every prompt position's logits of the rows in ``hook_rows`` (all rows when
        None); the LM head runs only on the positions someone reads."""
        ps = self.book.page_size
        ids: list[int] = []
        pos: list[int] = []
        wslots: list[int] = []
        keep: list[int] = []
        rows: list[tuple[int, int, torch.Tensor]] = []
        order: list[tuple[str, int, int, bool]] = []
        for row_id, start, n in plan.prefill:
            table = self.book.rows[row_id].pages
            at = len(ids)
            ids += tokens[row_id][start:start + n]
            pos += range(start, start + n)
            wslots += slots_for(table, start, start + n, ps)
            rows.append((at, n, self._row_slots(row_id, table)[:start + n]))
            hooked = prompt_hook is not None and (hook_rows is None or row_id in hook_rows)
            order.append((row_id, len(keep), n, hooked))
            keep += range(at, at + n) if hooked else [at + n - 1]
        decode = None
        if plan.decode:
            at0, ctxs = len(ids), []
            for row_id in plan.decode:
                book_row = self.book.rows[row_id]
                p = book_row.computed
                ids.append(tokens[row_id][p])
                pos.append(p)
                wslots.append(book_row.pages[p // ps] * ps + p % ps)
                ctxs.append((row_id, p, self._row_slots(row_id, book_row.pages)))
                order.append((row_id, len(keep), 1, False))
                keep.append(len(ids) - 1)
            decode = self._decode_batch(torch.arange(at0, len(ids), device=self.device), ctxs)
        elif self.lanes is not None:
            self.lanes.prepare([], self.store.k, self.store.v)  # no row decodes: every lane is free
        if not ids:
            return {}
        if len(self._slots) > len(self.book.rows):  # forget rows that left
            for gone in set(self._slots) - set(self.book.rows):
                del self._slots[gone]
        step = PackedStep(self.store, torch.tensor(wslots, device=self.device), rows, decode)
        with packed_forward():
            logits = self.model(input_ids=torch.tensor([ids], device=self.device),
                                position_ids=torch.tensor([pos], device=self.device), use_cache=False,
                                logits_to_keep=torch.tensor(keep, device=self.device), cohort_step=step).logits[0]
        out: dict[str, torch.Tensor] = {}
        for row_id, at, n, hooked in order:
            if hooked:
                prompt_hook(row_id, pos[keep[at]], logits[at:at + n])
                out[row_id] = logits[at + n - 1]
            else:
                out[row_id] = logits[at]
        return out
