"""The GPUs of this machine, probed live: ``nvidia-smi`` first, ``torch.cuda`` when it is absent.

Best effort by design: no GPU, no driver tool or an unreadable answer gives nothing (or a
coarser picture), never an error; the caller decides whether files must fill the gap.
"""

from __future__ import annotations

import shutil
import subprocess

from deployer.cluster import LINK_CLASSES, Cluster, Device, links_to_matrices
from deployer.cluster_files import cluster_from_topo, parse_gpu_csv


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
    lat, bw = links_to_matrices(names, LINK_CLASSES)
    return Cluster(devices=gpus, latency_ms=lat, link_names=names, bandwidth_gbps=bw, source="torch.cuda")
