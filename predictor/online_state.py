"""The online state of one predictor service: the conformal windows, the residual
correction, the prompt clusters and the log-DB cursor, in one JSON file written atomically.

Why one file: the parts and the cursor must move together (and a cluster key in the windows
must name the clusters saved beside them) — after a restart the service
must not learn a completion twice (cursor behind the state) or skip one (cursor ahead of it).
It lives next to the registry's versions (``<data_dir>/models/predictor/online_state.json``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from predictor.online_conformal import OnlineConformal
from predictor.online_residual import OnlineResidual
from predictor.prompt_clusters import PromptClusters
from predictor.registry import Registry

STATE_FILE = "online_state.json"


def state_path(data_dir: str | Path) -> Path:
    """Where a deployment's predictor service keeps its online state: next to the registry's versions."""
    return Registry(data_dir, "predictor").root / STATE_FILE


def snapshot_state(conformal: OnlineConformal, residual: OnlineResidual | None,
                   clusters: PromptClusters | None = None) -> dict[str, Any]:
    """Every part as plain data, copied: taken under the caller's lock, written after it."""
    return {"conformal": conformal.to_dict(), "residual": None if residual is None else residual.to_dict(),
            "clusters": None if clusters is None else clusters.to_dict()}


def write_state(path: str | Path, state: dict[str, Any]) -> None:
    """A ``snapshot_state`` to its file, via a temporary file + ``os.replace``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def load_state(path: str | Path, conformal_opts: dict[str, Any], residual_opts: dict[str, Any] | None,
               cluster_opts: dict[str, Any] | None = None
               ) -> tuple[OnlineConformal, OnlineResidual | None, PromptClusters | None]:
    """The saved state (settings override its parameters), or fresh parts when there is none or it
    cannot be read. ``residual_opts`` / ``cluster_opts`` None: no residual correction / no clusters."""
    try:
        d = json.loads(Path(path).read_text())
        conformal = OnlineConformal.from_dict(d["conformal"], **conformal_opts)
        saved = d.get("residual")
        residual = None
        if residual_opts is not None:
            residual = OnlineResidual.from_dict({**saved, **residual_opts}) if saved else OnlineResidual(**residual_opts)
        clusters = None
        if cluster_opts is not None:
            kept = d.get("clusters")
            clusters = PromptClusters.from_dict(kept, **cluster_opts) if kept else PromptClusters(**cluster_opts)
        return conformal, residual, clusters
    except (OSError, ValueError, KeyError, TypeError):
        return (OnlineConformal(**conformal_opts), None if residual_opts is None else OnlineResidual(**residual_opts),
                None if cluster_opts is None else PromptClusters(**cluster_opts))
