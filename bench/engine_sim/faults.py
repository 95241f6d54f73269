"""Injected faults, for testing what a front does when its engine misbehaves: dying mid-stream
(``--die-after``), stalling (``--stall-after``/``--stall-s``), answering 500 (``--error-rate``).

Counted over *admitted* requests (those that passed the error draw and the queue bound), so a
test knows exactly which request meets the fault. The error draw is seeded: a run repeats.
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


class Faults:
    def __init__(self, die_after: int = 0, stall_after: int = 0, stall_s: float = 0.0, error_rate: float = 0.0,
                 seed: int = 0, exit_fn: Callable[[int], None] = os._exit) -> None:
        if not 0.0 <= error_rate <= 1.0:
            raise ValueError(f"--error-rate must be within [0, 1], got {error_rate}")
        self.die_after = die_after
        self.stall_after = stall_after
        self.stall_s = stall_s
        self.error_rate = error_rate
        self._rng = random.Random(seed)
        self.exit_fn = exit_fn
        self.admitted = 0
        self.stall_until = 0.0     # time.monotonic() until which no token goes out
        self.stalled = False

    def draw_error(self) -> bool:
        """Whether this request answers 500 (a seeded draw per request)."""
        return self.error_rate > 0 and self._rng.random() < self.error_rate

    def admit(self) -> int:
        """Count one admitted request; returns its 1-based index. The ``stall_after``-th starts
        the stall (once)."""
        self.admitted += 1
        if self.stall_after and self.admitted >= self.stall_after and not self.stalled and self.stall_s > 0:
            self.stalled = True
            self.stall_until = time.monotonic() + self.stall_s
            log.warning("engine-sim: stalling %.2f s after %d requests", self.stall_s, self.admitted)
        return self.admitted

    def dies_at(self, index: int) -> bool:
        """Whether the request admitted ``index``-th is the one the process dies in."""
        return bool(self.die_after) and index == self.die_after

    def die(self) -> None:
        """Exit hard, as a crashed engine does: no clean-up, connections cut mid-stream."""
        log.warning("engine-sim: dying after %d admitted requests (--die-after)", self.admitted)
        for h in logging.getLogger().handlers:
            h.flush()
        self.exit_fn(3)

    async def wait_stall(self) -> None:
        """Hold the caller while a stall lasts (tokens are not lost: they go out after it)."""
        left = self.stall_until - time.monotonic()
        if left > 0:
            await asyncio.sleep(left)
