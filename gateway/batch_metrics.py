"""Batch API jobs on /metrics: jobs by status and their rows by state, read from the
log DB at scrape time — the job runner is a process without an HTTP port, and the log DB is where
the jobs' truth lives, so the gateway's one /metrics shows them."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from sqlalchemy import func, select

from cohort import jobdb

log = logging.getLogger("cohort.gateway")


class BatchJobs:
    """A collector: ``cohort_batch_jobs{status}`` and ``cohort_batch_rows{state}`` (rows of jobs
    not yet finished: pending, running, done, error)."""

    def __init__(self, state, registry: CollectorRegistry) -> None:
        self.state = state  # app.state: its ``db`` is set in the lifespan
        registry.register(self)

    def collect(self):
        db = getattr(self.state, "db", None)
        if db is None:
            return
        jobs = GaugeMetricFamily("cohort_batch_jobs", "Batch API jobs by status", labels=["status"])
        rows = GaugeMetricFamily("cohort_batch_rows", "Rows of unfinished Batch API jobs by state", labels=["state"])
        j, r = jobdb.batch_jobs, jobdb.batch_rows
        try:
            with db.connect() as conn:
                for status, n in conn.execute(select(j.c.status, func.count()).group_by(j.c.status)):
                    jobs.add_metric([status], n)
                live = select(j.c.id).where(j.c.status.in_(("validating", "in_progress", "finalizing", "cancelling")))
                for state, n in conn.execute(select(r.c.status, func.count()).where(r.c.batch_id.in_(live))
                                             .group_by(r.c.status)):
                    rows.add_metric([state], n)
        except Exception:  # the log DB away for a moment: the rest of /metrics still answers
            log.warning("batch job metrics unavailable", exc_info=True)
            return
        yield jobs
        yield rows
