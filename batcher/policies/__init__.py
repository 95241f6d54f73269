"""Batching policies by name. ``make_policy("magnus", ctx, threshold=...)``.

Every policy is pure Python (no torch, no Redis) so the simulator and the live batcher share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batcher.memory import KVMemory
from batcher.policies.base import BatchTimeModel, Policy, PolicyContext
from batcher.policies.priority import PriorityLevels
from batcher.policies.s3 import S3Policy
from batcher.policies.slo import ODBSPolicy, SLODBSPolicy, SLOODBSPolicy
from batcher.policies.spf import DEFAULT_AGING, DEFAULT_PREFIX_WINDOW, SPFPolicy
from batcher.policies.vs import VanillaPolicy
from batcher.policies.wma import ABPPolicy, GLPPolicy, MagnusPolicy, WMAPolicy

PolicyFactory = Callable[..., Policy]

_SLO_KEYS = ("w1", "w2", "l1", "l2", "slo_threshold", "max_batch_size")


def _slo_params(params: dict[str, Any]) -> dict[str, Any]:
    """The SLO-ODBS settings among ``params`` (Φ ``threshold`` and others belong to other policies)."""
    return {k: v for k, v in params.items() if k in _SLO_KEYS and v is not None}


POLICIES: dict[str, PolicyFactory] = {
    "vs": lambda ctx, batch_size=None, **_: VanillaPolicy(ctx, batch_size=batch_size),
    "glp": lambda ctx, threshold, batch_size=None, **_: GLPPolicy(ctx, threshold, batch_size=batch_size),
    "abp": lambda ctx, threshold, **_: ABPPolicy(ctx, threshold),
    "magnus": lambda ctx, threshold, **_: MagnusPolicy(ctx, threshold),
    "s3": lambda ctx, s3_window=2048, **_: S3Policy(ctx, window=s3_window),
    "s3-hrrn": lambda ctx, s3_window=2048, **_: S3Policy(ctx, window=s3_window, order="hrrn"),
    "slo-dbs": lambda ctx, **kw: SLODBSPolicy(ctx, **_slo_params(kw)),
    "odbs": lambda ctx, **kw: ODBSPolicy(ctx, **_slo_params(kw)),
    "slo-odbs": lambda ctx, **kw: SLOODBSPolicy(ctx, **_slo_params(kw)),
    "spf": lambda ctx, spf_aging=DEFAULT_AGING, spf_prefix_window=DEFAULT_PREFIX_WINDOW, **_: SPFPolicy(
        ctx, aging=spf_aging, prefix_window=spf_prefix_window),
}


def planning_memory(policy: str, memory: KVMemory, headroom: float, group_frac: float = 1.0) -> KVMemory:
    """Θ a policy plans with: Θ·(1 − headroom), slack for under-predicted lengths. VS sizes its
    batches for the worst case (max_tokens) and never needs slack: it always plans with Θ.
    Under continuous execution a batch is an admission group that joins rows already running,
    so it is planned with a share of Θ (``group_frac``): small groups join sooner and more often."""
    if not 0.0 <= headroom < 1.0:
        raise ValueError("headroom must be in [0, 1)")
    if not 0.0 < group_frac <= 1.0:
        raise ValueError("group_frac must be in (0, 1]")
    theta = memory.theta_bytes * group_frac
    if policy != "vs" and headroom:
        theta *= 1.0 - headroom
    return memory if theta == memory.theta_bytes else KVMemory(memory.delta_bytes, int(theta))


def group_share(execution: str, all_upstream: bool, builtin_frac: float, upstream_frac: float) -> float:
    """The share of Θ one batch is planned with (``planning_memory``'s ``group_frac``): all of it on the
    padded paths; under continuous execution a small share, a larger one where every instance of the
    pool is an upstream (its server streams each row on its own: a group is only how rows travel)."""
    if execution != "continuous":
        return 1.0
    return upstream_frac if all_upstream else builtin_frac


def make_policy(name: str, ctx: PolicyContext, **params: Any) -> Policy:
    """Build a policy by name; ``params`` may carry settings a policy ignores (threshold, batch_size…).
    Every policy honours per-request priority the same way (batcher.policies.priority)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return PriorityLevels(ctx, lambda: factory(ctx, **params))


__all__ = ["POLICIES", "BatchTimeModel", "ODBSPolicy", "Policy", "PolicyContext", "S3Policy", "SLODBSPolicy",
           "SLOODBSPolicy", "SPFPolicy", "VanillaPolicy", "WMAPolicy", "make_policy", "planning_memory"]
