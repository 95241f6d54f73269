"""Settings of what the retention pass keeps: log-DB rows, prompts, model versions, embedding cache
(``learning.retention``).

Read through the one settings object as ``settings.retention.<name>``, from ``COHORT_RETENTION__<NAME>``
variables (``cohort.settings``); tuning knobs a deployment rarely touches, grouped by the code that reads
them (``cohort`` is the bottom floor, so the groups live here).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class RetentionSettings(BaseModel):
    """What the retention pass keeps: log-DB rows, prompts, model versions, embedding cache
    (``learning.retention``)."""

    every_s: float = Field(default=300.0, gt=0.0, description="How often beat runs the retention pass.")
    log_max_age_s: float = Field(
        default=7 * 24 * 3600.0, gt=0.0, description="Log-DB rows (requests, batches) settled longer ago are deleted.")
    log_max_rows: int = Field(
        default=200_000, ge=100, description="Most request rows (and as many batch rows) the log DB keeps; the oldest "
        "settled rows go first.")
    prompt_age_s: float = Field(
        default=3600.0, ge=0.0, description="Prompts (instruction, user_input) of requests settled longer ago are "
        "blanked; their measurements (lengths, times, status) stay. Keep it above the retrain periods.")
    keep_versions: int = Field(
        default=5, ge=1, description="Model versions kept per target (predictor, estimator): the newest N and the "
        "active one; older ones are deleted (rollback reaches the kept ones).")
    cache_mb: int = Field(
        default=256, ge=1, description="Embedding-cache shards (<data_dir>/cache) kept up to this many MB; the "
        "oldest shards go first (a vector dropped is recomputed when needed).")
