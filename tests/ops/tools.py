"""Finding Prometheus's tools: skipped with a clear message where they are absent, a failure under CI
(``.ci/run`` installs Debian's ``prometheus`` package, which ships both)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "cohort-rules.yml"
RULES_TEST = ROOT / "deploy" / "prometheus" / "cohort-rules-test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "cohort.json"


def require_tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else None)
    if path:
        return path
    message = f"{name} not found: install it with `apt-get install -y prometheus` (Debian ships {name} in it)"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)
