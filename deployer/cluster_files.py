"""Clusters described in text: ``nvidia-smi topo -m`` output (link classes X, NV#, PIX, PXB, PHB,
NODE, SYS), ``nvidia-smi --query-gpu=index,name,memory.total,memory.used[,power.limit]
--format=csv`` output for memory (the topology matrix carries no memory figures), and YAML
cluster files (devices with memory, relative performance or power cap, and links as class names
or latencies in ms) - the way to describe a cluster you are not on, or to emulate heterogeneity
as the thesis did by capping power at 350/300/250/150 W.

Pure parsing: nothing here looks at the machine it runs on.
"""

from __future__ import annotations

import csv
import io
import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cohort.units import MIB
from deployer.cluster import (
    DEFAULT_P_MS_PER_GB,
    GB,
    LINK_CLASSES,
    Cluster,
    Device,
    LinkClass,
    link_class,
    links_to_matrices,
)

# --------------------------------------------------------------------------------------------
# nvidia-smi topo -m
# --------------------------------------------------------------------------------------------

_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _is_cell(tok: str) -> bool:
    return bool(re.fullmatch(r"X|NV\d+|PIX|PXB|PHB|NODE|SYS", tok.upper()))


def _is_header(line: str) -> bool:
    """The column header: GPU names, and either indented (as printed) or not followed by a cell."""
    toks = line.split()
    if not toks or not re.fullmatch(r"GPU\d+", toks[0]):
        return False
    return line[:1].isspace() or len(toks) < 2 or not _is_cell(toks[1])


def parse_topo_text(text: str) -> tuple[list[int], list[list[str]]]:
    """Parse ``nvidia-smi topo -m`` output into (GPU indices, matrix of link-class names).

    Only GPU rows/columns are kept (NIC columns, CPU/NUMA affinity and the legend are
    ignored); ANSI colour codes that some driver versions print are stripped.
    """
    lines = [_ANSI.sub("", ln).rstrip() for ln in text.splitlines()]
    header_idx = next((i for i, ln in enumerate(lines) if _is_header(ln)), None)
    if header_idx is None:
        raise ValueError("no GPU header line found; is this `nvidia-smi topo -m` output?")
    header = lines[header_idx].split()
    gpu_cols = [(pos, int(tok[3:])) for pos, tok in enumerate(header) if re.fullmatch(r"GPU\d+", tok)]
    gpu_ids = [g for _, g in gpu_cols]
    rows: dict[int, list[str]] = {}
    for ln in lines[header_idx + 1:]:
        toks = ln.split()
        if not toks or not re.fullmatch(r"GPU\d+", toks[0]):
            if toks and toks[0].startswith("Legend"):
                break
            continue
        cells = toks[1:]
        if len(cells) < len(gpu_cols):
            raise ValueError(f"topology row {toks[0]} has {len(cells)} cells, expected >= {len(gpu_cols)}")
        rows[int(toks[0][3:])] = [cells[pos] for pos, _ in gpu_cols]
    missing = [g for g in gpu_ids if g not in rows]
    if missing:
        raise ValueError(f"topology text lacks rows for GPUs {missing}")
    matrix = [rows[g] for g in gpu_ids]
    for i, row in enumerate(matrix):
        for j, cell in enumerate(row):
            link_class(cell)  # validate
            if (i == j) != (cell.upper() == "X"):
                raise ValueError(f"topology cell GPU{gpu_ids[i]}-GPU{gpu_ids[j]} is {cell!r}")
    return gpu_ids, matrix


def cluster_from_topo(topo_text: str, gpus: list[Device], source: str = "topo") -> Cluster:
    """Join a topology matrix with per-GPU memory/perf (matched by GPU index)."""
    ids, names = parse_topo_text(topo_text)
    by_id = {d.id: d for d in gpus}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"no memory information for GPUs {missing} (pass --gpus csv)")
    devices = [replace(by_id[i]) for i in ids]
    lat, bw = links_to_matrices(names, LINK_CLASSES)
    return Cluster(devices=devices, latency_ms=lat, link_names=names, bandwidth_gbps=bw, source=source)


def is_topo_text(text: str) -> bool:
    """True when ``text`` looks like ``nvidia-smi topo -m`` rather than a YAML cluster file."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError:
        return True
    if isinstance(doc, dict) and "devices" in doc:
        return False
    return bool(re.search(r"^\s*GPU\d+\s", _ANSI.sub("", text), flags=re.M))

# --------------------------------------------------------------------------------------------
# nvidia-smi --query-gpu csv
# --------------------------------------------------------------------------------------------


_NUM = re.compile(r"[-+]?\d+(?:\.\d+)?")


def _num(cell: str) -> float | None:
    m = _NUM.search(cell)
    return float(m.group()) if m else None


def parse_gpu_csv(text: str) -> list[Device]:
    """Parse ``nvidia-smi --query-gpu=index,name,memory.total,memory.used[,...] --format=csv``.

    Free memory = total - used (or ``memory.free`` when queried). ``power.limit`` (or
    ``power.max_limit``), when present, sets the relative performance proportional to the
    cap. Headerless (``noheader``) output is read as index,name,memory.total,memory.used
    in MiB.
    """
    rows = [r for r in csv.reader(io.StringIO(text.strip())) if r and any(c.strip() for c in r)]
    if not rows:
        raise ValueError("empty GPU csv")
    first = [c.strip().lower() for c in rows[0]]
    if any(c.startswith("index") or c.startswith("memory") for c in first):
        header, body = first, rows[1:]
    else:
        header, body = ["index", "name", "memory.total [mib]", "memory.used [mib]"], rows

    def col(prefix: str) -> int | None:
        return next((i for i, h in enumerate(header) if h.split(" ")[0] == prefix), None)

    ci, cn, ct, cu, cf = col("index"), col("name"), col("memory.total"), col("memory.used"), col("memory.free")
    cp = col("power.limit")
    if cp is None:
        cp = col("power.max_limit")
    if ci is None or (cf is None and (ct is None or cu is None)):
        raise ValueError(f"GPU csv needs index and memory.total+memory.used (or memory.free); got {header}")
    devices = []
    for r in body:
        r = [c.strip() for c in r]
        unit = 1 if "[b]" in (header[ct] if ct is not None else "") else MIB  # nvidia-smi reports MiB
        if cf is not None:
            free = _num(r[cf]) or 0.0
        else:
            free = (_num(r[ct]) or 0.0) - (_num(r[cu]) or 0.0)
        power = _num(r[cp]) if cp is not None else None
        devices.append(Device(id=int(_num(r[ci])), name=r[cn] if cn is not None else "GPU",
                              memory_bytes=int(max(free, 0.0) * unit), power_cap_w=power))
    _perf_from_power(devices)
    return devices


def _perf_from_power(devices: list[Device]) -> None:
    """Set perf proportional to the power cap where no explicit perf was given.

    The thesis emulated a heterogeneous cluster by power-capping identical GPUs; throughput
    under a power cap scales roughly with the cap, so perf_i = cap_i / max cap.
    """
    caps = [d.power_cap_w for d in devices if d.power_cap_w]
    if not caps:
        return
    top = max(caps)
    for d in devices:
        if d.power_cap_w:
            d.perf = d.power_cap_w / top

# --------------------------------------------------------------------------------------------
# YAML cluster file
# --------------------------------------------------------------------------------------------


def cluster_from_dict(doc: dict[str, Any], source: str = "yaml") -> Cluster:
    """Build a :class:`Cluster` from a parsed YAML document.

    Schema (see ``deployer/examples/thesis_4gpu.yaml``)::

        p_ms_per_gb: 1.07            # optional cost coefficient p
        link_classes:                # optional overrides of LINK_CLASSES
          PIX: {latency_ms: 0.02, bandwidth_gbps: 24}
        devices:
          - {id: 0, name: RTX 3090, memory_gb: 24, power_cap_w: 350}   # or perf: 1.0
        links:                       # n x n, class names or numbers (ms); or `latency_ms:`
          - [X, PIX, NODE, NODE]

    Explicit ``perf`` wins over ``power_cap_w``; a device with neither has perf 1.0.
    """
    if not isinstance(doc, dict) or "devices" not in doc:
        raise ValueError("cluster YAML needs a top-level `devices:` list")
    table = dict(LINK_CLASSES)
    for k, v in (doc.get("link_classes") or {}).items():
        base = table.get(str(k).upper(), LinkClass(0.1, 10.0))
        table[str(k).upper()] = LinkClass(float(v.get("latency_ms", base.latency_ms)),
                                          float(v.get("bandwidth_gbps", base.bandwidth_gbps)), str(k))
    devices: list[Device] = []
    explicit_perf: set[int] = set()
    for i, d in enumerate(doc["devices"]):
        if "memory_gb" in d:
            mem = int(float(d["memory_gb"]) * GB)
        elif "memory_bytes" in d:
            mem = int(d["memory_bytes"])
        elif "memory_mib" in d:
            mem = int(float(d["memory_mib"]) * MIB)
        else:
            raise ValueError(f"device {d} needs memory_gb, memory_mib or memory_bytes")
        dev = Device(id=int(d.get("id", i)), name=str(d.get("name", "GPU")), memory_bytes=mem,
                     perf=float(d.get("perf", 1.0)), power_cap_w=d.get("power_cap_w"))
        if "perf" in d:
            explicit_perf.add(dev.id)
        devices.append(dev)
    caps = [float(d.power_cap_w) for d in devices if d.power_cap_w]
    for d in devices:
        if d.id not in explicit_perf and d.power_cap_w:
            d.perf = float(d.power_cap_w) / max(caps)
    n = len(devices)
    links = doc.get("links")
    lat_doc = doc.get("latency_ms")
    names: list[list[str]] | None = None
    if links is not None:
        if len(links) != n or any(len(r) != n for r in links):
            raise ValueError(f"`links` must be a {n}x{n} matrix")
        if all(isinstance(c, str) for r in links for c in r):
            names = [[str(c) for c in r] for r in links]
            lat, bw = links_to_matrices(names, table)
        else:
            lat = np.zeros((n, n))
            bw = np.full((n, n), np.inf)
            for i, r in enumerate(links):
                for j, c in enumerate(r):
                    if isinstance(c, str):
                        lc = link_class(c, table)
                        lat[i, j], bw[i, j] = lc.latency_ms, lc.bandwidth_gbps
                    else:
                        lat[i, j] = float(c)
    elif lat_doc is not None:
        lat = np.asarray(lat_doc, dtype=float)
        bw = None
    else:
        raise ValueError("cluster YAML needs `links:` (class names or ms) or `latency_ms:`")
    lat = np.asarray(lat, dtype=float)
    if lat.shape != (n, n):
        raise ValueError(f"latency matrix must be {n}x{n}")
    if not np.allclose(lat, lat.T):
        raise ValueError("link latencies must be symmetric")
    return Cluster(devices=devices, latency_ms=lat, link_names=names, bandwidth_gbps=bw,
                   p_ms_per_gb=float(doc.get("p_ms_per_gb", DEFAULT_P_MS_PER_GB)), source=source)


def load_cluster_yaml(path: str | Path) -> Cluster:
    """Read a YAML cluster file (schema in :func:`cluster_from_dict`)."""
    doc = yaml.safe_load(Path(path).read_text())
    return cluster_from_dict(doc, source=str(path))
