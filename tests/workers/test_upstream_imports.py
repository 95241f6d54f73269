"""An upstream worker runs no model: starting one must not load torch or transformers' model code
(seconds of start and hundreds of MB per worker, for nothing)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.slow
def test_the_upstream_worker_path_imports_no_torch():
    code = ("import sys, workers.cli, workers.upstream_start, workers.tasks, learning.tasks; "
            "print(sorted(m for m in ('torch', 'transformers.modeling_utils', 'workers.engine') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
