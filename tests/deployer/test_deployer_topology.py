"""Reading clusters: nvidia-smi topo text, nvidia-smi csv, YAML files."""

from __future__ import annotations

import numpy as np
import pytest

from cohort.units import MIB
from deployer import gpu_probe
from deployer.cluster import GB, link_class
from deployer.cluster_files import cluster_from_dict, is_topo_text, parse_gpu_csv, parse_topo_text
from deployer.topology import load_cluster

DGX_LIKE = """\
\tGPU0\tGPU1\tGPU2\tNIC0\tCPU Affinity\tNUMA Affinity
GPU0\t X \tNV12\tSYS\tPXB\t0-63\t0
GPU1\tNV12\t X \tPHB\tSYS\t0-63\t0
GPU2\tSYS\tPHB\t X \tSYS\t64-127\t1
NIC0\tPXB\tSYS\tSYS\t X

Legend:
  X    = Self
"""


def test_thesis_topo_text(examples):
    ids, names = parse_topo_text((examples / "thesis_4gpu_topo.txt").read_text())
    assert ids == [0, 1, 2, 3]
    assert names[0] == ["X", "PIX", "NODE", "NODE"]
    assert names[2][3] == "PIX" and names[3][2] == "PIX"


def test_topo_nvlink_nic_columns_and_classes():
    ids, names = parse_topo_text(DGX_LIKE)
    assert ids == [0, 1, 2]
    assert names[0] == ["X", "NV12", "SYS"]  # NIC column dropped
    assert names[1][2] == "PHB"
    nv = link_class("NV12")
    assert nv.bandwidth_gbps == pytest.approx(12 * link_class("NV1").bandwidth_gbps)
    order = ["NV4", "PIX", "PXB", "PHB", "NODE", "SYS"]
    lats = [link_class(c).latency_ms for c in order]
    assert lats == sorted(lats) and len(set(lats)) == len(lats)
    assert link_class("X").latency_ms == 0.0


def test_topo_rejects_garbage():
    with pytest.raises(ValueError):
        parse_topo_text("hello world")
    with pytest.raises(ValueError):
        parse_topo_text("\tGPU0\tGPU1\nGPU0\t X \tFOO\nGPU1\tFOO\t X \n")


def test_gpu_csv_with_header_and_power(examples):
    devs = parse_gpu_csv((examples / "thesis_4gpu_gpus.csv").read_text())
    assert [d.id for d in devs] == [0, 1, 2, 3]
    assert devs[0].memory_bytes == (24576 - 512) * MIB
    assert [round(d.perf, 3) for d in devs] == [1.0, 0.857, 0.714, 0.429]


def test_gpu_csv_noheader_and_free_column():
    devs = parse_gpu_csv("0, A100, 40960, 1024\n1, A100, 40960, 40000\n")
    assert devs[0].memory_bytes == (40960 - 1024) * MIB and devs[1].memory_bytes == 960 * MIB
    assert all(d.perf == 1.0 for d in devs)
    devs = parse_gpu_csv("index, name, memory.free [MiB]\n0, H100, 80000 MiB\n")
    assert devs[0].memory_bytes == 80000 * MIB


def test_yaml_cluster(examples):
    c = load_cluster(examples / "thesis_4gpu.yaml")
    assert c.ids == [0, 1, 2, 3]
    assert [round(d.perf, 3) for d in c.devices] == [1.0, 0.857, 0.714, 0.429]
    assert c.devices[0].memory_bytes == int(23.5 * GB)
    assert c.latency_ms[0, 1] < c.latency_ms[0, 2]  # PIX closer than NODE
    assert np.allclose(c.latency_ms, c.latency_ms.T)


def test_yaml_latencies_and_explicit_perf():
    c = cluster_from_dict({
        "devices": [{"id": 0, "memory_gb": 10, "perf": 2.0}, {"id": 1, "memory_mib": 2048}],
        "links": [["X", 0.5], [0.5, "X"]],
    })
    assert c.devices[0].perf == 2.0 and c.devices[1].perf == 1.0
    assert c.devices[1].memory_bytes == 2 * GB
    assert c.latency_ms[0, 1] == 0.5
    with pytest.raises(ValueError):
        cluster_from_dict({"devices": [{"id": 0}]})
    with pytest.raises(ValueError):
        cluster_from_dict({"devices": [{"memory_gb": 1}, {"memory_gb": 1}], "latency_ms": [[0, 1], [2, 0]]})


def test_detection_and_merge(examples):
    assert is_topo_text((examples / "thesis_4gpu_topo.txt").read_text())
    assert not is_topo_text((examples / "thesis_4gpu.yaml").read_text())
    c = load_cluster(examples / "thesis_4gpu_topo.txt", examples / "thesis_4gpu_gpus.csv")
    assert c.link_names is not None and c.link_names[0][1] == "PIX"
    assert c.devices[3].perf == pytest.approx(150 / 350)
    # YAML + csv: csv memory replaces the YAML figure, YAML perf stays
    c2 = load_cluster(examples / "thesis_4gpu.yaml", examples / "thesis_4gpu_gpus.csv")
    assert c2.devices[0].memory_bytes == (24576 - 512) * MIB


def test_topo_text_without_memory_is_a_clear_error(examples, monkeypatch):
    monkeypatch.setattr(gpu_probe, "probe_gpus", lambda: [])
    with pytest.raises(ValueError, match="--gpus"):
        load_cluster(examples / "thesis_4gpu_topo.txt")
