"""The file store of the Batch API: a file's bytes under ``COHORT_FILES_DIR``
(default ``<COHORT_DATA_DIR>/files``), one file per id; its metadata is a log-DB row
(cohort.jobdb.files). Written to a temporary name and renamed, so a reader never sees half a
file and a crash leaves no partial one under a real id. Shared by the gateway (uploads,
downloads) and the job runner (output and error files), which see the same folder.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


class FileStore:
    """Bytes by file id in one folder."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def path(self, file_id: str) -> Path:
        if not _ID.fullmatch(file_id):  # ids are ours; this keeps a crafted one from leaving the folder
            raise ValueError(f"not a file id: {file_id!r}")
        return self.root / file_id

    def write(self, file_id: str, data: bytes) -> int:
        """Store ``data`` under ``file_id`` (replacing it: output files are rewritten idempotently)."""
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.path(file_id)
        tmp = final.with_name(f".{file_id}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return len(data)

    def read(self, file_id: str) -> bytes:
        return self.path(file_id).read_bytes()

    def delete(self, file_id: str) -> None:
        self.path(file_id).unlink(missing_ok=True)
