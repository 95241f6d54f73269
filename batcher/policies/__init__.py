"""Batching policies by name. ``make_policy("magnus", ctx, threshold=...)``.

Every policy is pure Python (no torch, no Redis) so the simulator and the live batcher share it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from batcher.policies.base import BatchTimeModel, Policy, PolicyContext
from batcher.policies.vs import VanillaPolicy
from batcher.policies.wma import ABPPolicy, GLPPolicy, MagnusPolicy, WMAPolicy

PolicyFactory = Callable[..., Policy]

POLICIES: dict[str, PolicyFactory] = {
    "vs": lambda ctx, batch_size=None, **_: VanillaPolicy(ctx, batch_size=batch_size),
    "glp": lambda ctx, threshold, batch_size=None, **_: GLPPolicy(ctx, threshold, batch_size=batch_size),
    "abp": lambda ctx, threshold, **_: ABPPolicy(ctx, threshold),
    "magnus": lambda ctx, threshold, **_: MagnusPolicy(ctx, threshold),
}


def make_policy(name: str, ctx: PolicyContext, **params: Any) -> Policy:
    """Build a policy by name; ``params`` may carry settings a policy ignores (threshold, batch_size…)."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None
    return factory(ctx, **params)


__all__ = ["POLICIES", "BatchTimeModel", "Policy", "PolicyContext", "WMAPolicy", "make_policy"]
