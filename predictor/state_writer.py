"""One writer of a state file among the processes that share it (several gateway processes on one
host, each learning the same completions from the log DB): the one holding an exclusive lock on
the file's ``.lock`` beside it. The kernel lets the lock go when its holder dies, however it dies,
and the next process that tries takes it over; no process ever waits for it."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path


class StateWriter:
    """``held()``: True while this process is the file's one writer (tries to become it when not)."""

    def __init__(self, path: str | Path) -> None:
        self.lock_path = Path(path).with_name(Path(path).name + ".lock")
        self._fd: int | None = None

    def held(self) -> bool:
        if self._fd is not None:
            return True
        self.lock_path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._fd = fd
        return True

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor lets the lock go
            self._fd = None
