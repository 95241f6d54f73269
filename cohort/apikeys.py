"""API keys: how a key is stored and named, and the job runner's own credential.

A key is kept only as its SHA-256: keys are 256-bit random strings (or operator-chosen ones in
``COHORT_API_KEYS``), so a fast hash is enough — there is no password to brute-force — and the
gateway can check a key with one dictionary lookup per request. A key's *id* (``key-…`` for a
created key, ``env-`` + 12 hex digits of the hash for a configured one) is what owns files and
batches and what usage is counted under; the key itself appears nowhere but in the client.

The job runner sends a job's rows through the gateway like any client, on behalf of the job's
key. It proves it is the runner with a secret kept in ``<COHORT_DATA_DIR>/offline/secret``
(made at first use, mode 0600, like the embedded Redis password): whoever can read the data
folder can read the log DB anyway.
"""

from __future__ import annotations

import hashlib
import os
import secrets
from pathlib import Path

KEY_PREFIX = "sk-cohort-"
RUNNER_HEADER = "x-cohort-batch-owner"  # the runner names the job's key id in it
ROW_REQUEST_HEADER = "x-cohort-row-request"  # the runner names the id its row's request is to have


def row_request_id(row_id: str, attempt: int) -> str:
    """The request id of a job row's ``attempt``: fixed by the row, so a runner that sends a row
    again after losing its answer (a gateway restart, its own) re-attaches to the request already
    in the system instead of running it twice (gateway.reattach)."""
    return f"req-{row_id.replace(':', '-')}-{attempt}"
# The gateway sets this Redis key (a timestamp) when interactive generation requests arrive; the
# job runner reads it to keep fewer rows in flight while they do (offline.runner).
INTERACTIVE_SEEN_KEY = "cohort:offline:interactive_seen"


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def env_key_id(key_hash: str) -> str:
    return "env-" + key_hash[:12]


def new_key() -> str:
    return KEY_PREFIX + secrets.token_urlsafe(32)


def configured_keys(value: str | None) -> list[str]:
    """The keys of ``COHORT_API_KEYS`` (comma-separated; blanks dropped)."""
    return [k.strip() for k in (value or "").split(",") if k.strip()]


def runner_secret(data_dir: Path) -> str:
    """The job runner's credential, made once and shared through the data folder."""
    path = Path(data_dir) / "offline" / "secret"
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_urlsafe(32)
    tmp = path.with_suffix(f".{os.getpid()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret)
    try:
        os.link(tmp, path)  # first writer wins; a concurrent one reads the winner's
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return path.read_text().strip()
