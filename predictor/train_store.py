"""The bounded training store of continuous learning: a recent window plus a reservoir.

Why bounded: a store that only grows makes every retrain slower than the last (19 s,
then 127 … 344 s under load, each one stealing a core from serving). The store keeps

- the newest ``recent`` rows as they are (what the served model does now), and
- a uniform sample of at most ``reservoir`` rows of everything older (Vitter's algorithm R), so
  old behaviour is still remembered without keeping all of it.

The file is JSON lines, reservoir rows first, then the recent window oldest first; the number of
rows that ever left the window (what algorithm R needs) lives in ``<store>.meta.json``. Every
change rewrites the file atomically (temporary file + ``os.replace``): it holds at most
``recent + reservoir`` rows, so a rewrite is cheap, and a reader never sees half a file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

RESERVOIR_TAG = "_reservoir"  # set on rows that left the recent window and were sampled into the reservoir


def _meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta.json")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """Every stored row (reservoir first, then the recent window oldest first)."""
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _read_meta(path: Path) -> dict[str, int]:
    try:
        return json.loads(_meta_path(path).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def bound_rows(rows: Sequence[dict[str, Any]], recent: int, reservoir: int, seen_old: int,
               rng: np.random.Generator) -> tuple[list[dict[str, Any]], int]:
    """Apply the bound to ``rows`` (reservoir rows tagged, then the window in arrival order):
    rows beyond the newest ``recent`` leave the window oldest first and go through algorithm R
    into a reservoir of ``reservoir`` rows. Returns (rows to keep, rows ever past the window)."""
    res = [r for r in rows if r.get(RESERVOIR_TAG)]
    window = [r for r in rows if not r.get(RESERVOIR_TAG)]
    overflow, window = window[:max(0, len(window) - recent)], window[max(0, len(window) - recent):]
    for row in overflow:
        seen_old += 1
        row = {**row, RESERVOIR_TAG: True}
        if len(res) < reservoir:
            res.append(row)
        elif reservoir:
            j = int(rng.integers(seen_old))
            if j < reservoir:
                res[j] = row
    return res[:reservoir] + window, seen_old


def append_bounded(path: Path, new: Sequence[dict[str, Any]], recent: int, reservoir: int) -> int:
    """Add ``new`` rows to the store at ``path`` and apply the bound (``new`` may be empty: then
    this only compacts, e.g. after the bounds were lowered). Returns the rows now stored."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = read_rows(path)
    meta = _read_meta(path)
    seen_old = int(meta.get("seen_old", 0))
    rng = np.random.default_rng(seen_old + len(rows) + len(new))  # reproducible, different each round
    kept, seen_old = bound_rows([*rows, *new], recent, reservoir, seen_old, rng)
    if not new and len(kept) == len(rows):
        return len(rows)  # nothing to change: no rewrite
    _write_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in kept))
    _write_atomic(_meta_path(path), json.dumps({"seen_old": seen_old, "rows": len(kept)}))
    return len(kept)
