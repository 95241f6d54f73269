"""Cluster description for the HELR planner: devices and the links between them.

HELR needs three facts per cluster: each device's usable memory, its relative compute
performance, and a hop-latency matrix. They can come from three places, so this module
reads all of them into one :class:`Cluster`:

* ``nvidia-smi topo -m`` text (link classes X, NV#, PIX, PXB, PHB, NODE, SYS), optionally
  with ``nvidia-smi --query-gpu=index,name,memory.total,memory.used[,power.limit] --format=csv``
  text for memory (the topology matrix carries no memory figures);
* a YAML cluster file (devices with memory, relative performance or power cap, and links
  as class names or latencies in ms) - the way to describe a cluster you are not on, or to
  emulate heterogeneity as the thesis did by capping power at 350/300/250/150 W;
* live probing through ``nvidia-smi`` / ``torch.cuda`` when GPUs exist.

Link classes are turned into latencies with a small table (:data:`LINK_CLASSES`). The
numbers are order-of-magnitude defaults, not measurements: what matters to the planner is
that NV# < PIX < PXB < PHB < NODE < SYS, and a YAML file can override any of them.
"""

from __future__ import annotations

import csv
import io
import re
import shutil
import subprocess
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from cohort.units import GIB, MIB

GB = GIB  # memory sizes in cluster files are given in GiB

#: Default ms per GB of weights read at relative performance 1.0, i.e. 1 / (936 GB/s), the
#: memory bandwidth of the RTX 3090 the thesis used. Decode is bandwidth-bound, so one
#: token's pass over a layer costs roughly its bytes divided by bandwidth.
DEFAULT_P_MS_PER_GB = 1.0 / 0.936


@dataclass(frozen=True)
class LinkClass:
    """Latency/bandwidth class of one ``nvidia-smi topo -m`` connection type."""

    latency_ms: float
    bandwidth_gbps: float
    description: str = ""


#: Connection types of ``nvidia-smi topo -m`` ordered from closest to farthest. NV# is
#: handled in :func:`link_class` (more bonded NVLinks -> more bandwidth).
LINK_CLASSES: dict[str, LinkClass] = {
    "X": LinkClass(0.0, float("inf"), "self"),
    "NV": LinkClass(0.005, 25.0, "NVLink (per bonded link)"),
    "PIX": LinkClass(0.02, 24.0, "at most a single PCIe bridge"),
    "PXB": LinkClass(0.03, 20.0, "multiple PCIe bridges, no host bridge"),
    "PHB": LinkClass(0.05, 16.0, "PCIe host bridge (CPU)"),
    "NODE": LinkClass(0.08, 12.0, "PCIe + interconnect between host bridges in a NUMA node"),
    "SYS": LinkClass(0.15, 8.0, "PCIe + SMP interconnect between NUMA nodes"),
}


def link_class(name: str, table: dict[str, LinkClass] | None = None) -> LinkClass:
    """Resolve a topo cell (``PIX``, ``NV4``, ...) to its :class:`LinkClass`.

    ``NV#`` bonds # NVLinks: bandwidth scales with #, latency is the NVLink latency.
    """
    table = table or LINK_CLASSES
    key = name.strip().upper()
    m = re.fullmatch(r"NV(\d+)", key)
    if m:
        base = table.get("NV", LINK_CLASSES["NV"])
        return LinkClass(base.latency_ms, base.bandwidth_gbps * int(m.group(1)), f"{m.group(1)} NVLinks")
    if key not in table:
        raise ValueError(f"unknown link class {name!r}; expected one of X, NV#, {', '.join(list(table)[2:])}")
    return table[key]


@dataclass
class Device:
    """One accelerator as the planner sees it.

    ``memory_bytes`` is memory *available to the model* (free memory), before the KV reserve T.
    ``perf`` is relative compute performance (1.0 = the reference device); when only a power
    cap is known, performance is taken proportional to it, as in the thesis's experiment.
    """

    id: int
    name: str = "GPU"
    memory_bytes: int = 0
    perf: float = 1.0
    power_cap_w: float | None = None


@dataclass
class Cluster:
    """Devices plus pairwise hop latencies (ms) and, when known, link class names."""

    devices: list[Device]
    latency_ms: np.ndarray
    link_names: list[list[str]] | None = None
    bandwidth_gbps: np.ndarray | None = None
    p_ms_per_gb: float = DEFAULT_P_MS_PER_GB
    source: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = len(self.devices)
        self.latency_ms = np.asarray(self.latency_ms, dtype=float)
        if self.latency_ms.shape != (n, n):
            raise ValueError(f"latency matrix is {self.latency_ms.shape}, expected {(n, n)} for {n} devices")
        if self.bandwidth_gbps is None:
            self.bandwidth_gbps = np.full((n, n), np.inf)

    @property
    def ids(self) -> list[int]:
        return [d.id for d in self.devices]

    def index_of(self, device_id: int) -> int:
        return self.ids.index(device_id)

    def hop_matrix_ms(self, activation_bytes: float = 0.0) -> np.ndarray:
        """Latency of a pipeline hop: link latency plus moving ``activation_bytes`` over the link.

        The activation term is usually tiny (hidden_size x 2 bytes per token) but makes a
        slow link cost more as batches grow.
        """
        bw = np.asarray(self.bandwidth_gbps, dtype=float)
        with np.errstate(divide="ignore", invalid="ignore"):
            transfer = np.where(np.isfinite(bw) & (bw > 0), activation_bytes / (bw * 1e9) * 1e3, 0.0)
        hop = self.latency_ms + transfer
        np.fill_diagonal(hop, 0.0)
        return hop


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


def _links_to_matrices(names: list[list[str]], table: dict[str, LinkClass]) -> tuple[np.ndarray, np.ndarray]:
    n = len(names)
    lat = np.zeros((n, n))
    bw = np.full((n, n), np.inf)
    for i in range(n):
        for j in range(n):
            c = link_class(names[i][j], table)
            lat[i, j], bw[i, j] = c.latency_ms, c.bandwidth_gbps
    return lat, bw


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
            lat, bw = _links_to_matrices(names, table)
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


# --------------------------------------------------------------------------------------------
# Putting it together
# --------------------------------------------------------------------------------------------


def cluster_from_topo(topo_text: str, gpus: list[Device], source: str = "topo") -> Cluster:
    """Join a topology matrix with per-GPU memory/perf (matched by GPU index)."""
    ids, names = parse_topo_text(topo_text)
    by_id = {d.id: d for d in gpus}
    missing = [i for i in ids if i not in by_id]
    if missing:
        raise ValueError(f"no memory information for GPUs {missing} (pass --gpus csv)")
    devices = [replace(by_id[i]) for i in ids]
    lat, bw = _links_to_matrices(names, LINK_CLASSES)
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


def load_cluster(topology_file: str | Path | None = None, gpus_file: str | Path | None = None) -> Cluster:
    """Load a cluster from files, falling back to live probing for what the files lack.

    * YAML topology: complete on its own; a ``--gpus`` csv, if given, replaces each
      device's memory with the measured free memory (keeps YAML perf/links).
    * topo text: needs memory from ``--gpus`` csv, else from live probing.
    * nothing: live probing (raises if no GPU is visible).
    """
    gpus = parse_gpu_csv(Path(gpus_file).read_text()) if gpus_file else None
    if topology_file is None:
        live = probe_live()
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
        gpus = probe_gpus()
        if not gpus:
            raise ValueError(f"{topology_file} is topology text without memory figures: pass --gpus "
                             "(nvidia-smi --query-gpu=index,name,memory.total,memory.used --format=csv)")
    return cluster_from_topo(text, gpus, source=str(topology_file))


# --------------------------------------------------------------------------------------------
# Live probing
# --------------------------------------------------------------------------------------------


def _run(cmd: list[str]) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True)
    except (subprocess.SubprocessError, OSError):
        return None
    return out.stdout


def probe_gpus() -> list[Device]:
    """Free memory and power caps of visible GPUs: nvidia-smi first, then torch.cuda."""
    text = _run(["nvidia-smi", "--query-gpu=index,name,memory.total,memory.used,power.limit",
                 "--format=csv"])
    if text:
        try:
            return parse_gpu_csv(text)
        except ValueError:
            pass
    try:
        import torch  # seconds to import: only to probe live GPUs (parsing a topology needs none)
    except ImportError:  # pragma: no cover - torch is a dependency
        return []
    if not torch.cuda.is_available():
        return []
    devices = []
    for i in range(torch.cuda.device_count()):
        free, _total = torch.cuda.mem_get_info(i)
        devices.append(Device(id=i, name=torch.cuda.get_device_name(i), memory_bytes=int(free)))
    return devices


def probe_live() -> Cluster | None:
    """Describe the local GPUs, or None when there are none.

    Links come from ``nvidia-smi topo -m``; without it, peer access (``can_device_access_peer``)
    is read as PIX-class and its absence as SYS-class.
    """
    gpus = probe_gpus()
    if not gpus:
        return None
    topo = _run(["nvidia-smi", "topo", "-m"])
    if topo:
        try:
            return cluster_from_topo(topo, gpus, source="nvidia-smi")
        except ValueError:
            pass
    n = len(gpus)
    names = [["X" if i == j else "SYS" for j in range(n)] for i in range(n)]
    try:
        import torch  # only to probe live GPUs, as in probe_gpus

        for i in range(n):
            for j in range(n):
                if i != j and torch.cuda.can_device_access_peer(gpus[i].id, gpus[j].id):
                    names[i][j] = "PIX"
    except Exception:  # noqa: BLE001 - probing is best effort
        pass
    lat, bw = _links_to_matrices(names, LINK_CLASSES)
    return Cluster(devices=gpus, latency_ms=lat, link_names=names, bandwidth_gbps=bw, source="torch.cuda")
