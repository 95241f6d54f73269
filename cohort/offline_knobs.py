"""Settings of the Batch API job runner: how much background work it keeps in flight, at what priority, and
when it yields (``offline.runner``).

Read through the one settings object as ``settings.offline.<name>``, from ``COHORT_OFFLINE__<NAME>``
variables (``cohort.settings``); tuning knobs a deployment rarely touches, grouped by the code that reads
them (``cohort`` is the bottom floor, so the groups live here).
"""

from __future__ import annotations

from pydantic import BaseModel, Field


class OfflineSettings(BaseModel):
    """The Batch API job runner: how much background work it keeps in flight, at what priority, and when it
    yields (``offline.runner``)."""

    gateway_url: str | None = Field(
        default=None, description="Where the job runner sends a job's rows (the gateway's submit path); "
        "unset: http://<COHORT_HOST>:<COHORT_PORT>.")
    max_outstanding: int = Field(default=64, ge=1, description="Rows of batch jobs the runner keeps "
                                         "in flight at once (all jobs together): the background work's share of the queue.")
    priority: int = Field(default=10, description="Request priority of a job's rows while its window is "
                                  "young (lower is served earlier; interactive requests default to 0).")
    urgent_after: float = Field(default=0.5, ge=0.0, le=1.0, description="Fraction of the completion "
                                        "window after which a job's rows rise linearly from COHORT_OFFLINE__PRIORITY "
                                        "to 0, reached at 90 % of the window.")
    yield_outstanding: int = Field(default=8, ge=1, description="Rows of batch jobs the runner keeps in "
                                           "flight while interactive requests arrive (within COHORT_OFFLINE__YIELD_S): "
                                           "a batch cannot be interrupted, so small background batches keep the wait "
                                           "of an interactive request short.")
    yield_s: float = Field(default=10.0, ge=0.0, description="How long after the last interactive request "
                                   "the runner keeps yielding (COHORT_OFFLINE__YIELD_OUTSTANDING); 0: never yields.")
    max_attempts: int = Field(default=8, ge=1, description="Times a row is sent again after a transient "
                                      "failure (429, 503, a lost worker; backing off exponentially up to 30 s) before its error is final. A gateway "
                                      "that does not answer at all costs no attempt: the runner waits for it.")
    poll_s: float = Field(default=0.5, gt=0.0, description="How often the job runner looks for new, "
                                  "cancelled and finished jobs.")
