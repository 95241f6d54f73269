"""Settings of the learning worker: how often it retrains, what it starts from, its bounded training store and
its share of the CPU (``predictor.learning``, ``learning.tasks``).

Read through the one settings object as ``settings.learning.<name>``, from ``COHORT_LEARNING__<NAME>``
variables (``cohort.settings``); tuning knobs a deployment rarely touches, grouped by the code that reads
them (``cohort`` is the bottom floor, so the groups live here).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class LearningSettings(BaseModel):
    """The learning worker: how often it retrains, what it starts from, its bounded training store and its
    share of the CPU (``predictor.learning``, ``learning.tasks``)."""

    predictor_every_s: float = 180.0
    estimator_every_s: float = 120.0
    min_new_samples: int = Field(
        default=32, ge=1, description="A periodic predictor retrain fits only once this many new samples "
        "(mispredicted served requests) have been stored since the last fit; fewer wait for the next round")
    seed_rows_per_task: int = Field(
        default=500, description="First retraining: rows per Magnus task from ../shared/data's train split "
        "to start the training set with (0: start from the log DB only).")
    store_recent_rows: int = Field(
        default=2000, ge=1, description="Training store (predictor and estimator): the newest rows kept as they "
        "are (the recent window); older rows fall into the reservoir.")
    store_reservoir_rows: int = Field(
        default=2000, ge=0, description="Training store: rows kept from everything older than the recent window, "
        "a uniform sample (reservoir sampling), so old behaviour is remembered without the store growing.")
    cpu_share: float = Field(
        default=0.25, gt=0.0, le=1.0, description="The share of the machine's cores the learning worker may use: "
        "its torch/OMP/BLAS threads (share x cores, at least 1) and a duty cycle (a watcher stops and continues "
        "it so its CPU time stays under share x cores over each second). 1.0: no duty cycle.")
    nice: int = Field(default=19, ge=0, le=19, description="os.nice increment of the learning worker "
                               "(19: lowest priority; serving processes win every contended core).")
