"""Hot reload, written once: the model a service uses follows its source (a registry's ACTIVE
version, or a fixed directory) and is swapped in with one assignment when the source changes.

The source is checked at most once per ``interval_s`` (one ``stat``); a change is loaded under
a lock, so two threads never load the same version twice; a version that fails to load is
remembered and not retried every second (the service keeps what it had).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar

log = logging.getLogger(__name__)
M = TypeVar("M")

# (change key, version, loader): the loader builds the model to use, or is None when there is
# nothing to load (the service keeps its current model).
Source = Callable[[], tuple[Any, str | None, Callable[[], M] | None]]


class HotSwap(Generic[M]):
    """``current`` = (model, version); ``maybe_reload()`` follows ``source``."""

    def __init__(self, name: str, source: Source, initial: M, interval_s: float = 1.0) -> None:
        self.name, self.source, self.interval_s = name, source, float(interval_s)
        self.current: tuple[M, str | None] = (initial, None)
        self._key: Any = object()  # nothing loaded from the source yet
        self._last_check = 0.0
        self._lock = threading.Lock()

    def due(self) -> bool:
        return time.monotonic() - self._last_check >= self.interval_s

    def maybe_reload(self, force: bool = False) -> bool:
        """Swap in what the source names if it changed; True when a new model is in use."""
        if not force and not self.due():
            return False
        self._last_check = time.monotonic()
        try:
            key, version, load = self.source()
        except OSError:
            return False
        if key == self._key or load is None:
            return False
        with self._lock:
            if key == self._key:
                return False
            self._key = key  # a broken version is not retried every second
            t0 = time.perf_counter()
            try:
                model = load()
            except Exception:
                log.exception("cannot load %s %s; keeping %s", self.name, version, self.current[1])
                return False
            self.current = (model, version)  # one assignment: readers see old or new, never a mix
            log.info("%s now %s (loaded in %.2f s)", self.name, version or "the default", time.perf_counter() - t0)
            return True
