"""`cohort predictor coverage`: how often live requests outgrew the bound they were planned with.

Why: the q90 bound is what memory planning reserves, and a row that outgrows it is preempted. The
replay benchmark measures coverage on recorded data; this reads it from the live log DB, where the
gateway writes each request's planned bound (``requests.predicted_upper``) at admission and the
worker its actual length at completion — so a deployment can check its coverage on its own traffic.
Only rows a model planned count (``service.model_planned``, the same rule the online learner uses).
Where the service has fitted prompt clusters (``predictor.prompt_clusters``, saved in its online
state) the report also splits the rows by cluster, so an operator sees whether each kind of
traffic is covered and not only the mixture. Rows are put in the clusters as they are *now*.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import typer

from cohort.logdb import finished_requests, get_db_engine
from cohort.settings import get_settings
from predictor.online_state import load_state, state_path
from predictor.prompt_clusters import PromptClusters
from predictor.service import logged_item, model_planned


def planned_coverage(rows: list[dict[str, Any]], last: int | None = None,
                     clusters: PromptClusters | None = None) -> dict[str, Any]:
    """Coverage of the logged planned bound per model pool and overall, over the last ``last`` rows
    (in completion order) that a model planned and that carry their bound; ``n`` 0 and coverage None
    when there are none (e.g. a log DB written before the bound was logged). With fitted
    ``clusters``, also per prompt cluster."""
    used = [r for r in rows if model_planned(r) and r.get("predicted_upper") is not None]
    if last:
        used = used[-last:]

    def stats(part: list[dict[str, Any]]) -> dict[str, Any]:
        n = len(part)
        if not n:
            return {"n": 0, "q90_coverage": None, "upper_mean": None, "point_mean": None, "actual_mean": None}
        return {"n": n, "q90_coverage": sum(r["actual_tokens"] <= r["predicted_upper"] for r in part) / n,
                "upper_mean": sum(r["predicted_upper"] for r in part) / n,  # what planning reserved
                "point_mean": sum(r["predicted_tokens"] for r in part) / n,
                "actual_mean": sum(r["actual_tokens"] for r in part) / n}

    pools: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in used:
        pools[r.get("model") or ""].append(r)
    report = {"all": stats(used), "pools": {p: stats(rs) for p, rs in sorted(pools.items())}}
    if clusters is not None and clusters.fitted is not None and used:
        keys = clusters.assign([logged_item(r) for r in used])
        by_cluster: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for r, key in zip(used, keys, strict=True):
            by_cluster[str(key)].append(r)
        report["clusters"] = {k: stats(rs) for k, rs in sorted(by_cluster.items())}
    return report


def saved_clusters() -> PromptClusters | None:
    """The prompt clusters in the predictor service's saved online state (None: off or none yet)."""
    s = get_settings()
    if s.online.clusters <= 0:
        return None
    path = state_path(s.data_dir)
    return load_state(path, {}, None, {"k": s.online.clusters})[2] if path.is_file() else None


def coverage_command(
    since_s: float = typer.Option(3600.0, help="Rows completed in the last this many seconds."),
    last: int = typer.Option(500, help="Of those, the last N rows a model planned (0: all)."),
    json_out: Path = typer.Option(None, "--json", help="Write the report here too."),
) -> None:
    """Live q90 coverage: the share of completed requests that stayed within the bound they were
    planned with, per model pool (and per prompt cluster once there are any), read from the
    configured log DB."""
    engine = get_db_engine(get_settings().database_url)
    report = {"since_s": since_s, "last": last,
              **planned_coverage(finished_requests(engine, since=time.time() - since_s), last or None,
                                 saved_clusters())}
    typer.echo(json.dumps(report, indent=2))
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(report, indent=2))
