"""Versioned model directories with an atomically switched ACTIVE pointer.

Layout: ``<data_dir>/models/<target>/<version>/`` (target = ``predictor`` | ``estimator``), each
with a ``meta.json`` (kind, data, metrics, created), and ``<data_dir>/models/<target>/ACTIVE``
holding the active version's name. ACTIVE is written to a temporary file and ``os.replace``d,
so a reader (the gateway, the batcher) sees the old version or the new one, never a torn
write. Versions are never deleted by activation: rollback = activate an older version.

Version names sort by creation time (``v20240604-120102-3f2a``), so "latest" is the last.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from predictor.base import META_FILE

TARGETS = ("predictor", "estimator")
ACTIVE_FILE = "ACTIVE"


class UnknownVersion(KeyError):
    """Raised when a version does not exist in the registry."""


def new_version_name() -> str:
    """A sortable, unique version name: v<UTC date>-<time>-<nanoseconds><random>. Nanoseconds,
    not milliseconds: two versions made in the same millisecond must still sort oldest first."""
    ns = time.time_ns()
    now = datetime.fromtimestamp(ns // 1_000_000_000, timezone.utc)
    return f"v{now:%Y%m%d-%H%M%S}-{ns % 1_000_000_000:09d}{uuid.uuid4().hex[:4]}"


class Registry:
    """The versions of one target (predictor or estimator) under ``<data_dir>/models/<target>``."""

    def __init__(self, data_dir: str | Path, target: str = "predictor") -> None:
        if target not in TARGETS:
            raise ValueError(f"target must be one of {TARGETS}, not {target!r}")
        self.target = target
        self.root = Path(data_dir) / "models" / target

    @property
    def active_file(self) -> Path:
        return self.root / ACTIVE_FILE

    def path(self, version: str) -> Path:
        if not version or "/" in version or "\\" in version or version.startswith("."):
            raise UnknownVersion(version)
        return self.root / version

    def exists(self, version: str) -> bool:
        try:
            return (self.path(version) / META_FILE).is_file()
        except UnknownVersion:
            return False

    def versions(self) -> list[str]:
        """Complete versions (with meta.json), oldest first."""
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir()
                      if p.is_dir() and not p.name.startswith(".") and (p / META_FILE).is_file())

    def meta(self, version: str) -> dict[str, Any]:
        if not self.exists(version):
            raise UnknownVersion(version)
        return json.loads((self.path(version) / META_FILE).read_text())

    def active(self) -> str | None:
        """The active version, or None when none is set (or it points at a missing version)."""
        try:
            v = self.active_file.read_text().strip()
        except FileNotFoundError:
            return None
        return v if v and self.exists(v) else None

    def active_path(self) -> Path | None:
        v = self.active()
        return self.path(v) if v else None

    def active_mtime(self) -> float | None:
        """mtime_ns of ACTIVE (cheap change detection for hot reload)."""
        try:
            return self.active_file.stat().st_mtime_ns
        except FileNotFoundError:
            return None

    def activate(self, version: str) -> None:
        """Point ACTIVE at ``version`` atomically (tmp file + os.replace)."""
        if not self.exists(version):
            raise UnknownVersion(version)
        self.root.mkdir(parents=True, exist_ok=True)
        tmp = self.root / f".{ACTIVE_FILE}.{uuid.uuid4().hex}.tmp"
        tmp.write_text(version + "\n")
        os.replace(tmp, self.active_file)

    def new_dir(self) -> tuple[str, Path]:
        """A fresh staging directory (hidden until ``commit``) and its future version name."""
        version = new_version_name()
        while (self.root / version).exists():
            time.sleep(0.002)
            version = new_version_name()
        staging = self.root / f".staging-{version}"
        staging.mkdir(parents=True, exist_ok=False)
        return version, staging

    def commit(self, version: str, staging: Path, meta_update: dict[str, Any] | None = None,
               activate: bool = True) -> Path:
        """Make a staged directory a version (rename is atomic), stamping meta.json, and activate it."""
        meta_path = staging / META_FILE
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        meta.update(meta_update or {})
        meta.setdefault("created", datetime.now(timezone.utc).isoformat())
        meta["version"] = version
        meta_path.write_text(json.dumps(meta, indent=2, default=str))
        final = self.root / version
        os.replace(staging, final)
        if activate:
            self.activate(version)
        return final

    def register_dir(self, source: str | Path, meta_update: dict[str, Any] | None = None,
                     activate: bool = True) -> str:
        """Copy an existing model directory into the registry as a new version."""
        source = Path(source)
        if not (source / META_FILE).is_file():
            raise FileNotFoundError(f"{source} has no {META_FILE}: not a model directory")
        version, staging = self.new_dir()
        shutil.copytree(source, staging, dirs_exist_ok=True)
        self.commit(version, staging, meta_update, activate=activate)
        return version

    def listing(self) -> dict[str, Any]:
        """What the admin endpoint shows: every version's meta summary and which is active."""
        active = self.active()
        out = []
        for v in self.versions():
            try:
                m = self.meta(v)
            except (OSError, ValueError):
                continue
            out.append({"version": v, "kind": m.get("kind"), "created": m.get("created"),
                        "metrics": m.get("metrics"), "data": m.get("data"), "active": v == active})
        return {"target": self.target, "active": active, "versions": out}
