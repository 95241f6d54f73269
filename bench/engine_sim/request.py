"""One simulated request: its prompt and output tokens, where its computation stands, the chained
hashes of its full KV blocks, and the stream its tokens go out on.

The scheduler reasons the way vLLM v1's does, in tokens: a request has ``num_tokens`` (prompt +
output so far) and ``num_computed_tokens`` (those whose KV is in its blocks); each step tries to
close that gap. Prefill, chunked prefill, decode and the recompute after a preemption are all the
same rule, which is why one counter pair describes every state.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass, field

ROOT_HASH = 0x5EED  # the parent "hash" of a request's first block


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED = "finished"
    ABORTED = "aborted"


class Stream:
    """Where a request's tokens wait for its HTTP handler. The engine appends ids and sets the
    event; the handler takes everything pending at once, so a handler that falls behind a step
    gets one chunk of several tokens (as vLLM's output collector merges them) instead of a
    backlog of chunks."""

    __slots__ = ("pending", "finish", "event")

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.finish: str | None = None
        self.event = asyncio.Event()

    def push(self, token_id: int, finish: str | None = None) -> None:
        self.pending.append(token_id)
        if finish is not None:
            self.finish = finish
        self.event.set()

    async def take(self) -> tuple[list[int], str | None]:
        """Every token pending (waiting for at least one), and the finish reason once the last
        one is among them."""
        while not self.pending and self.finish is None:
            self.event.clear()
            await self.event.wait()
        ids, self.pending = self.pending, []
        return ids, self.finish


@dataclass(eq=False)
class SimRequest:
    """A request inside the simulated engine (identity equality: two bodies may be equal)."""

    request_id: str
    prompt_ids: list[int]
    max_tokens: int
    draw: Callable[[], int]                 # the next output token id (deterministic per request)
    priority: int = 0
    arrival: float = 0.0                    # model seconds
    status: Status = Status.WAITING
    num_computed_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = -1             # prefix-cache hit at first scheduling (usage.cached_tokens)
    num_preemptions: int = 0
    block_hashes: list[int] = field(default_factory=list)
    stream: Stream | None = None
    first_token_at: float | None = None     # model seconds
    last_token_at: float | None = None
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_ids)

    def update_block_hashes(self, block_size: int) -> list[int]:
        """Extend the chain of full-block hashes to every full block of ``num_tokens``: block i's
        hash covers its own tokens and, through its parent's hash, every token before it, so two
        requests share block i's KV exactly when they share the first (i+1)·block_size tokens."""
        hashes = self.block_hashes
        while (len(hashes) + 1) * block_size <= self.num_tokens:
            start = len(hashes) * block_size
            parent = hashes[-1] if hashes else ROOT_HASH
            end, n = start + block_size, len(self.prompt_ids)
            tokens = (tuple(self.prompt_ids[start:end]) if end <= n
                      else tuple(self.prompt_ids[start:n] + self.output_ids[max(0, start - n):end - n]))
            hashes.append(hash((parent, tokens)))
        return hashes
