"""The shared workload data (../shared/data): loading, the seeded 80/20 split, token targets.

Records are ``{"task", "instruction", "input", "output", "source"}``. The split is by a seeded
permutation per file, so train and validation never overlap and every run sees the same split.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cohort.settings import get_settings

MAGNUS_TASKS = ("mt_en_zh", "mt_zh_en", "gc", "td", "ct_java_cs", "ct_cs_java", "bf", "cc")
SPLIT_SEED = 20240604


@dataclass(frozen=True)
class Record:
    task: str
    instruction: str
    input: str
    output: str
    source: str = ""


def shared_data_dir() -> Path:
    """``Settings.shared_dir``/data (COHORT_SHARED_DIR; default ../shared next to the repo). Fails
    loudly under CI, which must have the data."""
    d = (get_settings().shared_dir / "data").resolve()
    if not d.is_dir() and os.environ.get("CI"):
        raise FileNotFoundError(f"shared data directory {d} is missing (CI requires ../shared/data)")
    return d


def load_jsonl(path: str | Path, limit: int | None = None) -> list[Record]:
    """Read a .jsonl or .jsonl.gz file of records."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    out: list[Record] = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            d = json.loads(line)
            out.append(Record(d.get("task") or path.name.split(".")[0], d.get("instruction") or "",
                              d.get("input") or "", d.get("output") or "", d.get("source") or ""))
            if limit is not None and len(out) >= limit:
                break
    return out


def split(records: Sequence[Record], train_frac: float = 0.8, seed: int = SPLIT_SEED
          ) -> tuple[list[Record], list[Record]]:
    """Seeded 80/20 split of one file's records (train, validation)."""
    idx = np.random.default_rng(seed).permutation(len(records))
    cut = int(round(train_frac * len(records)))
    return [records[i] for i in idx[:cut]], [records[i] for i in idx[cut:]]


def load_split(paths: Iterable[str | Path], part: str, limit_per_file: int | None = None,
               seed: int = SPLIT_SEED) -> list[Record]:
    """The ``part`` ('train' | 'val' | 'all') of each file, split per file, concatenated.

    ``limit_per_file`` subsamples *after* splitting (seeded), so a small run still never mixes
    train and validation rows.
    """
    out: list[Record] = []
    for p in paths:
        recs = load_jsonl(p)
        if part != "all":
            tr, va = split(recs, seed=seed)
            recs = tr if part == "train" else va
        if limit_per_file is not None and len(recs) > limit_per_file:
            pick = np.random.default_rng(seed + 1).choice(len(recs), limit_per_file, replace=False)
            recs = [recs[i] for i in sorted(pick)]
        out.extend(recs)
    return out


def data_files(names: Iterable[str] | None = None) -> list[Path]:
    """Paths of shared data files by task name (default: the eight Magnus tasks)."""
    d = shared_data_dir()
    out = []
    for name in names or MAGNUS_TASKS:
        for cand in (d / f"{name}.jsonl", d / f"{name}.jsonl.gz"):
            if cand.exists():
                out.append(cand)
                break
        else:
            raise FileNotFoundError(f"no data file for task {name!r} in {d}")
    return out
