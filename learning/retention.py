"""The retention pass: what keeps disk flat under steady load.

Beat runs it every COHORT_RETENTION__EVERY_S on the learning queue (so it also runs at the
learner's low priority). Each bound has its own setting:

- log DB: settled rows older than COHORT_RETENTION__LOG_MAX_AGE_S, and the oldest beyond
  COHORT_RETENTION__LOG_MAX_ROWS, are deleted; prompts are blanked after
  COHORT_RETENTION__PROMPT_AGE_S while the measurements stay (cohort.logdb.prune_log);
- model versions: the newest COHORT_RETENTION__KEEP_VERSIONS per target and the active one;
- training stores: compacted to the recent window + reservoir (predictor.train_store), which
  matters when the bounds were lowered (each retrain applies them to what it adds);
- the embedding cache: oldest shards beyond COHORT_RETENTION__CACHE_MB.

Redis needs no pass: a finished request's stream expires COHORT_STREAM_END_TTL_S after its
final event (cohort.bus.publish), and the embedded server evicts only keys with a TTL under its
maxmemory (procstack.embedded_redis). The pass reports what it sees of both.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from cohort.logdb import get_db_engine, log_counts, prune_log
from cohort.settings import Settings
from predictor.learning import estimator_store, predictor_store
from predictor.registry import TARGETS, Registry
from predictor.train_store import append_bounded

log = logging.getLogger(__name__)


def prune_versions(reg: Registry, keep: int) -> list[str]:
    """Delete every version but the newest ``keep`` and the active one; returns the deleted.
    A reader loading a version while it is deleted fails that load and keeps the one it has
    (predictor.hotswap); the active version is never deleted."""
    active = reg.active()
    versions = reg.versions()
    doomed = [v for v in versions[:max(0, len(versions) - keep)] if v != active]
    for v in doomed:
        shutil.rmtree(reg.path(v), ignore_errors=True)
    # staging folders left by a learner killed mid-save (older than an hour: not being written)
    if reg.root.is_dir():
        for p in reg.root.glob(".staging-*"):
            if time.time() - p.stat().st_mtime > 3600:
                shutil.rmtree(p, ignore_errors=True)
    return doomed


def prune_cache(cache_dir: Path, max_bytes: int) -> int:
    """Delete the oldest embedding-cache shards beyond ``max_bytes``; returns how many."""
    if not cache_dir.is_dir():
        return 0
    shards = sorted((p for p in cache_dir.rglob("*.npz") if p.is_file()), key=lambda p: p.stat().st_mtime)
    total = sum(p.stat().st_size for p in shards)
    removed = 0
    for p in shards:
        if total <= max_bytes:
            break
        total -= p.stat().st_size
        p.unlink(missing_ok=True)
        removed += 1
    return removed


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (what `du` would count, without holes)."""
    if not path.exists():
        return 0
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def retention_pass(settings: Settings, now: float | None = None) -> dict[str, Any]:
    """Apply every bound once; returns what was removed and what remains."""
    now = time.time() if now is None else now
    engine = get_db_engine(settings.database_url)
    out: dict[str, Any] = {"log": prune_log(engine, now, settings.retention.log_max_age_s,
                                            settings.retention.log_max_rows, settings.retention.prompt_age_s)}
    if engine.dialect.name == "sqlite":
        # copy the write-ahead log back into the main file so its pages are reused. PASSIVE: it
        # never blocks the gateway's and workers' writes — this process runs at nice 19 and may be
        # stopped by its duty cycle, so it must hold no lock they could wait on.
        with engine.connect() as conn:
            conn.exec_driver_sql("PRAGMA wal_checkpoint(PASSIVE)")
    out["log_rows"] = log_counts(engine)
    out["versions_deleted"] = {t: len(prune_versions(Registry(settings.data_dir, t), settings.retention.keep_versions))
                               for t in TARGETS}
    out["store_rows"] = {name: append_bounded(path, [], settings.learning.store_recent_rows,
                                              settings.learning.store_reservoir_rows)
                         for name, path in (("predictor", predictor_store(settings)),
                                            ("estimator", estimator_store(settings))) if path.is_file()}
    out["cache_shards_deleted"] = prune_cache(Path(settings.data_dir) / "cache",
                                              settings.retention.cache_mb * 1024 * 1024)
    out["data_dir_bytes"] = dir_bytes(Path(settings.data_dir))
    return out
