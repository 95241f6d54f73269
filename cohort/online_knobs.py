"""Settings of online recalibration of the predictor's upper quantile and point correction
(``predictor.online_conformal``).

Read through the one settings object as ``settings.online.<name>``, from ``COHORT_ONLINE__<NAME>`` variables
(``cohort.settings``); tuning knobs a deployment rarely touches, grouped by the code that reads them
(``cohort`` is the bottom floor, so the groups live here).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class OnlineSettings(BaseModel):
    """Online recalibration of the predictor's upper quantile and point correction
    (``predictor.online_conformal``)."""

    conformal: bool = Field(
        default=True, description="Recalibrate the q90 upper bound online from completions (rolling window + "
        "adaptive conformal inference per pool × task / instruction); off: the model's static table only.")
    window: int = Field(
        default=250, ge=10, description="Completions per group in the online conformal window.")
    gamma: float = Field(
        default=0.005, ge=0.0, le=0.5, description="ACI step size γ (Gibbs & Candès 2021): how fast the level "
        "reacts to misses of the upper bound.")
    min_rows: int = Field(
        default=30, ge=1, description="Scores a group needs before its own online bound is used "
        "(fewer: the pool-wide online bound, then the model's static table).")
    clusters: int = Field(
        default=8, ge=0, description="Prompt clusters (k of an online k-means over the instruction's static "
        "MiniLM vector) that unlabelled traffic is calibrated in, between the instruction and the pool-wide "
        "group; 0: none. See predictor/prompt_clusters.py and docs/notes/predictors.md.")
    correction: bool = Field(
        default=True, description="Also correct the point prediction online: a forgetting ridge on the log "
        "residual over cross-source cues, learnt from completions (needs COHORT_ONLINE__CONFORMAL).")
    forget: float = Field(
        default=0.998, gt=0.0, le=1.0, description="Forgetting factor of the online correction per completion "
        "(memory ≈ 1/(1−λ) completions).")
    ridge: float = Field(
        default=30.0, ge=0.0, description="Ridge penalty of the online correction (pulls it to no correction).")
    interval_s: float = Field(
        default=2.0, gt=0.0, description="How often the predictor service reads new completions from the "
        "log DB to update the online bound.")
