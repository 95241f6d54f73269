"""HELR deployer: topology-aware placement of a model's layers on heterogeneous GPUs.

Public surface:

* :func:`plan_device_map` - what a worker calls before ``from_pretrained(..., device_map=...)``;
* :class:`DeploymentInfeasible` - raised when no device subset can hold the model;
* ``deployer.cli:app`` - the ``cohort deploy plan`` command.

Only :mod:`deployer.helr` (the search) is imported eagerly; torch/transformers are loaded
when a model is actually read.
"""

from __future__ import annotations

from typing import Any

from deployer.helr_cost import DeploymentInfeasible

__all__ = ["DeploymentInfeasible", "plan_device_map"]


def plan_device_map(model_path: str, mode: str, topology_file: str | None = None, gpus_file: str | None = None,
                    kv_reserve_bytes: int | None = None, **kwargs: Any) -> dict[str, int] | None:
    """Planned HF device_map for ``model_path``, or None without CUDA (then load on CPU).

    Thin lazy wrapper over :func:`deployer.planner.plan_device_map` (which pulls in torch);
    extra keyword arguments (``a1``, ``a2``, ``dtype``, ``require_cuda``) pass through.
    """
    from deployer.planner import plan_device_map as _impl  # torch + transformers: only when planning

    return _impl(model_path, mode, topology_file, gpus_file, kv_reserve_bytes, **kwargs)
