"""AdaptiveLLM's swap (§3.3) on the continuous engine: an evicted row's KV pages are copied to a
host pool and copied back into fresh pages when it resumes, instead of being dropped and
prefilled again. The choice per victim is ``batcher.preemption.choose_preemption``; this module
holds the host copies and measures the link both ways.

The pool lives outside Θ: on CUDA in pinned host memory (``COHORT_SWAP_BYTES``, default 4 GiB),
on a CPU device a separate buffer (default off: both sides are host memory, a copy saves only the
recompute). Capacity is counted in tokens of KV.
"""

from __future__ import annotations

import time

import torch

from batcher.preemption import SwapLink
from workers.paged_attention import PageStore


class HostSwapPool:
    """Host copies of swapped rows' KV: per row, a key and a value tensor per layer."""

    def __init__(self, capacity_tokens: int, pin: bool) -> None:
        self.capacity_tokens, self.pin = capacity_tokens, pin
        self.rows: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.used = 0

    @property
    def free_tokens(self) -> int:
        return self.capacity_tokens - self.used

    def swap_out(self, row_id: str, store: PageStore, slots: torch.Tensor) -> None:
        """Copy the KV at ``slots`` (the row's context, in position order) to the host."""
        copies = []
        for k, v in zip(store.k, store.v, strict=True):
            hk = torch.empty((len(slots), *k.shape[1:]), dtype=k.dtype, pin_memory=self.pin)
            hv = torch.empty((len(slots), *v.shape[1:]), dtype=v.dtype, pin_memory=self.pin)
            hk.copy_(k[slots], non_blocking=self.pin)
            hv.copy_(v[slots], non_blocking=self.pin)
            copies.append((hk, hv))
        if self.pin:
            torch.cuda.synchronize()
        self.rows[row_id] = copies
        self.used += len(slots)

    def swap_in(self, row_id: str, store: PageStore, slots: torch.Tensor) -> int:
        """Copy a swapped row's KV into ``slots`` (its new pages); the tokens restored."""
        copies = self.rows.pop(row_id)
        n = len(copies[0][0])
        for (k, v), (hk, hv) in zip(zip(store.k, store.v, strict=True), copies, strict=True):
            k[slots[:n]] = hk.to(k.device, non_blocking=self.pin)
            v[slots[:n]] = hv.to(v.device, non_blocking=self.pin)
        self.used -= n
        return n

    def drop(self, row_id: str) -> None:
        """The row ended while swapped (cancelled): its copy goes."""
        copies = self.rows.pop(row_id, None)
        if copies:
            self.used -= len(copies[0][0])


def measure_link(device: torch.device, dtype: torch.dtype, nbytes: int = 32 << 20) -> SwapLink:
    """Host↔device bandwidth each way, measured once at start (pinned memory on CUDA)."""
    n = max(1, nbytes // torch.tensor([], dtype=dtype).element_size())
    pin = device.type == "cuda"
    host = torch.empty(n, dtype=dtype, pin_memory=pin)
    dev = torch.empty(n, dtype=dtype, device=device)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(3):
            if pin:
                torch.cuda.synchronize(device)
            t = time.perf_counter()
            dst.copy_(src, non_blocking=pin)
            if pin:
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - t)
        return max(best, 1e-9)

    return SwapLink(to_host_bytes_per_s=nbytes / timed(host, dev), to_device_bytes_per_s=nbytes / timed(dev, host))
