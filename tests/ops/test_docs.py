"""The docs site: it builds (`mkdocs build --strict`), its Configuration page names every `COHORT_*`
variable and no other, its API page every path of the app's OpenAPI document, the README stays short
with the two commands, and no user page cites tracker issue numbers (the notes under docs/notes do)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import sys

import pytest

from tests.ops.tools import ROOT

DOCS = ROOT / "docs"


def _gen():
    spec = importlib.util.spec_from_file_location("gen_reference", DOCS / "tools" / "gen_reference.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_configuration_page_names_every_variable_and_no_other():
    variables = {v for v, *_ in _gen().settings_variables()}
    documented = set(re.findall(r"^\| `(COHORT_[A-Z0-9_]+)`", (DOCS / "configuration.md").read_text(), re.M))
    assert variables - documented == set(), "undocumented: run .venv/bin/python docs/tools/gen_reference.py"
    assert documented - variables == set(), "documented but not a setting: run docs/tools/gen_reference.py"


def test_every_variable_named_in_the_user_docs_exists():
    variables = {v for v, *_ in _gen().settings_variables()}
    for page in [ROOT / "README.md", *(p for p in DOCS.rglob("*.md") if "notes" not in p.parts)]:
        for name in re.findall(r"\bCOHORT_[A-Z0-9_]*[A-Z0-9]\b", page.read_text()):
            if name.endswith("_") or name in ("COHORT_GROUP",):
                continue
            assert name in variables or any(v.startswith(name) for v in variables), f"{page.name}: {name}"


def test_api_page_lists_every_path():
    doc = _gen().openapi()
    text = (DOCS / "api.md").read_text()
    for path, ops in doc["paths"].items():
        for method in ops:
            assert f"`{method.upper()} {path}`" in text, f"{method} {path}: run docs/tools/gen_reference.py"


@pytest.mark.slow  # 1.09 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_mkdocs_build_strict(tmp_path):
    mkdocs = shutil.which("mkdocs", path=str(ROOT / ".venv" / "bin")) or shutil.which("mkdocs")
    if mkdocs is None:
        pytest.skip("mkdocs not installed: .venv/bin/pip install mkdocs (it is in the dev extras)")
    out = subprocess.run([mkdocs, "build", "--strict", "-q", "-f", str(ROOT / "mkdocs.yml"), "-d", str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (tmp_path / "index.html").exists()


def test_readme_short_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert "make serve   # fresh machine: creates .venv, installs, starts everything embedded on 127.0.0.1:8000" in text
    assert "make test    # fresh machine: creates .venv, installs, runs the whole test suite" in text


def test_no_issue_numbers_outside_the_notes():
    for page in [ROOT / "README.md", *(p for p in DOCS.rglob("*.md") if "notes" not in p.parts)]:
        hits = re.findall(r"\b[Ii]ssues? #?\d+", page.read_text())
        assert not hits, f"{page.relative_to(ROOT)}: {hits}"


if __name__ == "__main__":
    sys.exit(pytest.main([__file__]))
