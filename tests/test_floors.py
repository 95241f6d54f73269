"""The house rules that the code's shape must keep: imports run one way, down the floors, and no
product module outgrows one job (400 lines).

Imports are read with ``ast`` from every module of every product package (a folder at the
repository root with an ``__init__.py``, tests aside), function-level imports included: a
package found later is checked without touching this file.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").is_file() and p.name != "tests")
MAX_LINES = 400

# What each package may import from the others. Bottom to top: cohort (contracts, settings) and
# procstack (the local process stack) import no product package; taskq (the Celery app: task
# names, queues, broker settings) only the contracts; the batcher and the predictor
# run inside the simulator and never reach the model, Celery or an entry point; workers are the
# LLM instance and learning the learner (neither imports the other); gateway and bench use what is
# below them; launch (the `cohort` command) is on
# top and imported by nothing. A package not named here may import anything but launch.
MAY_IMPORT: dict[str, set[str]] = {
    "cohort": set(),
    "procstack": set(),
    "taskq": {"cohort"},
    "deployer": {"cohort"},
    "batcher": {"cohort"},
    "predictor": {"cohort"},
    # the upstream path: the engine's client and the gateway's streaming (cohort only), the worker's
    # admission, endpoint health and failover (which plug into the worker's loop interface)
    "upstream": {"cohort", "batcher", "workers"},
    "workers": {"cohort", "batcher", "predictor", "deployer", "taskq", "upstream"},
    "learning": {"cohort", "predictor", "taskq"},
    "gateway": {"cohort", "batcher", "predictor", "taskq", "upstream"},
    "bench": {"cohort", "batcher", "predictor", "deployer", "procstack"},
    "offline": {"cohort", "procstack"},  # the Batch API's job runner: a client of the gateway
    "launch": set(PACKAGES) - {"launch"},
}



def product_modules() -> list[Path]:
    return sorted(f for pkg in PACKAGES for f in (ROOT / pkg).rglob("*.py"))


def imported_packages(path: Path) -> set[str]:
    """The product packages a module imports (absolute imports; relative ones stay inside)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        out |= {n.split(".")[0] for n in names} & set(PACKAGES)
    return out


def test_the_rules_name_every_floor() -> None:
    assert {"cohort", "procstack", "batcher", "predictor", "workers", "gateway", "bench", "launch"} <= set(PACKAGES)


@pytest.mark.parametrize("pkg", PACKAGES)
def test_imports_run_down_the_floors(pkg: str) -> None:
    allowed = MAY_IMPORT.get(pkg, set(PACKAGES) - {"launch"}) | {pkg}
    wrong = {f"{f.relative_to(ROOT)} imports {sorted(bad)}"
             for f in (ROOT / pkg).rglob("*.py") if (bad := imported_packages(f) - allowed)}
    assert not wrong, sorted(wrong)


def test_the_import_reader_sees_function_level_imports(tmp_path: Path) -> None:
    f = tmp_path / "m.py"
    f.write_text("import os\nfrom cohort.types import Batch\n\ndef g():\n    from launch import cli\n"
                 "    import workers.engine\n")
    assert imported_packages(f) == {"cohort", "launch", "workers"}


def test_every_product_module_fits_one_job() -> None:
    lines = {str(f.relative_to(ROOT)): len(f.read_text().splitlines()) for f in product_modules()}
    over = {path: n for path, n in lines.items() if n > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines: {over}"


def public_names(path: Path) -> set[str]:
    """The module's top-level public classes and functions (what another package can import)."""
    tree = ast.parse(path.read_text())
    return {n.name for n in tree.body
            if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and not n.name.startswith("_")}


@pytest.mark.slow  # half a second or more of real work: `make test` runs it, the fast loop does not
def test_one_name_per_concept_across_packages() -> None:
    """Two packages never define the same public class or function name for different things
    (a reader who meets ``BatchRun`` must know which world it lives in). Re-exports are imports,
    not definitions, so a package ``__init__`` that re-exports its own module is fine."""
    where: dict[str, set[str]] = {}
    for f in product_modules():
        for name in public_names(f):
            where.setdefault(name, set()).add(f.relative_to(ROOT).parts[0])
    shared = {name: sorted(pkgs) for name, pkgs in where.items() if len(pkgs) > 1}
    assert not shared, f"names defined in more than one package: {shared}"


def test_every_product_package_is_installed() -> None:
    """`make serve` runs the installed `cohort` script, whose path does not hold the repository:
    a package missing from pyproject's list imports only from the repository root (the `offline`
    package once did, and `cohort` failed to start)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    listed = {p.rstrip("*") for p in patterns}
    assert set(PACKAGES) - listed == set()


def test_no_issue_numbers_in_product_code() -> None:
    """Code says why in a line; the tracker and docs/ carry the history and the measurements."""
    pattern = re.compile(r"\bissues? #?\d+", re.IGNORECASE)
    hits = [f"{path.relative_to(ROOT)}:{n}" for pkg in PACKAGES for path in sorted((ROOT / pkg).rglob("*.py"))
            for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1) if pattern.search(line)]
    assert not hits, f"issue numbers in product code: {hits}"
