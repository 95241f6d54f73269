"""Where a cluster description comes from: the HELR planner needs each device's usable memory,
its relative compute performance, and a hop-latency matrix, from a YAML cluster file, from
``nvidia-smi`` text (topology + a memory csv), or from the GPUs of this machine - and a mix of
them (files first, live probing for what they lack). :func:`load_cluster` is that choice; the
data model is ``deployer.cluster``, the parsers ``deployer.cluster_files``, the probing
``deployer.gpu_probe``.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from deployer import gpu_probe
from deployer.cluster import Cluster
from deployer.cluster_files import cluster_from_dict, cluster_from_topo, is_topo_text, parse_gpu_csv


def load_cluster(topology_file: str | Path | None = None, gpus_file: str | Path | None = None) -> Cluster:
    """Load a cluster from files, falling back to live probing for what the files lack.

    * YAML topology: complete on its own; a ``--gpus`` csv, if given, replaces each
      device's memory with the measured free memory (keeps YAML perf/links).
    * topo text: needs memory from ``--gpus`` csv, else from live probing.
    * nothing: live probing (raises if no GPU is visible).
    """
    gpus = parse_gpu_csv(Path(gpus_file).read_text()) if gpus_file else None
    if topology_file is None:
        live = gpu_probe.probe_live()
        if live is None:
            raise RuntimeError("no topology file given and no CUDA GPU to probe")
        return live
    text = Path(topology_file).read_text()
    if not is_topo_text(text):
        cluster = cluster_from_dict(yaml.safe_load(text), source=str(topology_file))
        if gpus:
            by_id = {d.id: d for d in gpus}
            for d in cluster.devices:
                if d.id in by_id:
                    d.memory_bytes = by_id[d.id].memory_bytes
        return cluster
    if gpus is None:
        gpus = gpu_probe.probe_gpus()
        if not gpus:
            raise ValueError(f"{topology_file} is topology text without memory figures: pass --gpus "
                             "(nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv)")
    return cluster_from_topo(text, gpus, source=str(topology_file))
