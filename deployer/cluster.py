"""The cluster as the HELR planner sees it: devices (usable memory, relative performance) and
the links between them (hop latency, bandwidth), with the link classes of ``nvidia-smi topo -m``.

Link classes are turned into latencies with a small table (:data:`LINK_CLASSES`). The
numbers are order-of-magnitude defaults, not measurements: what matters to the planner is
that NV# < PIX < PXB < PHB < NODE < SYS, and a YAML file can override any of them.
Where the facts come from is elsewhere: files (``deployer.cluster_files``), the GPUs of this
machine (``deployer.gpu_probe``), either (``deployer.topology.load_cluster``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from cohort.units import GIB

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


def links_to_matrices(names: list[list[str]], table: dict[str, LinkClass]) -> tuple[np.ndarray, np.ndarray]:
    """Latency and bandwidth matrices of a matrix of link-class names."""
    n = len(names)
    lat = np.zeros((n, n))
    bw = np.full((n, n), np.inf)
    for i in range(n):
        for j in range(n):
            c = link_class(names[i][j], table)
            lat[i, j], bw[i, j] = c.latency_ms, c.bandwidth_gbps
    return lat, bw
