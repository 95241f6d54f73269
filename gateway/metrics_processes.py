"""/metrics when several gateway processes serve one port (COHORT_GATEWAY_PROCESSES): a scrape
reaches one of them, and must show every process's counts, once.

Each process's counters and histograms go to files in one folder (prometheus_client's multiprocess
mode, on when ``PROMETHEUS_MULTIPROC_DIR`` is set before the process imports it: ``cohort gateway``
sets it for its children); a scrape adds every file up. What a scrape reads itself — the queue,
instance and pool gauges read from Redis, the log DB's collectors — is read by the process that
answers, as with one process: added up over processes it would be counted N times. The files of
a process that died stay and keep counting: a counter never goes back.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"


def fresh_metrics_dir(data_dir: Path, port: int) -> Path:
    """The folder the gateway processes of ``port`` count into, emptied (a new start counts from 0)."""
    path = Path(data_dir).resolve() / "metrics" / f"gateway-{port}"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


class _Scrape:
    """Every process's counters and histograms from the files; this process's other collectors."""

    def __init__(self, registry: CollectorRegistry, path: str) -> None:
        self.registry, self.path = registry, Path(path)

    def collect(self) -> Iterator[Metric]:
        files = [str(f) for kind in ("counter", "histogram") for f in sorted(self.path.glob(f"{kind}_*.db"))]
        yield from MultiProcessCollector.merge(files, accumulate=True)
        for collector in list(self.registry._collector_to_names):  # the registry's own list, read-only
            if not isinstance(collector, (Counter, Histogram)):
                yield from collector.collect()


def exposition(registry: CollectorRegistry) -> bytes:
    """The registry in Prometheus's text format: as it is in one process, added up over the
    processes in multiprocess mode."""
    path = os.environ.get(MULTIPROCESS_ENV)
    return generate_latest(_Scrape(registry, path) if path else registry)  # type: ignore[arg-type]
