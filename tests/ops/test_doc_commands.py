"""Every `cohort …` command the docs show exists: README.md, the user docs (docs/ outside docs/notes/)
and scripts/*.sh are walked for inline code spans that start with `cohort`, command lines in code
blocks and scripts (also after `&&`, `;`, `VAR=x`, `taskset -c N`, `.venv/bin/`), and each is resolved
against the Typer app, sub-commands included."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer.main

from launch.cli import app

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").rglob("*.md") if "notes" not in p.parts),
           *sorted((ROOT / "scripts").glob("*.sh"))]
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")
ALTERNATIVES = re.compile(r"^[a-z0-9-]+(\|[a-z0-9-]+)+$")  # `cohort batch run|runner`


def _words(segment: str) -> list[str] | None:
    """The words of a `cohort` command in one shell segment, None when it runs something else."""
    try:
        words = shlex.split(segment, comments=True)
    except ValueError:
        words = segment.split()
    while words and (ENV.match(words[0]) or words[0] in ("sudo", "exec", "time", "nohup")):
        words = words[1:]
    if len(words) >= 3 and words[0] == "taskset" and words[1] == "-c":
        words = words[3:]
    if not words or words[0].rsplit("/", 1)[-1] != "cohort":
        return None
    return words[1:]


def _segments(line: str) -> list[str]:
    return [s for s in re.split(r"&&|\|\||;|\$\(|`", line) if s.strip()]


def commands() -> list[tuple[str, list[str]]]:
    found: list[tuple[str, list[str]]] = []
    for path in SOURCES:
        text = path.read_text()
        where = str(path.relative_to(ROOT))
        spans = re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text) if path.suffix == ".md" else []
        lines: list[str] = []
        if path.suffix == ".sh":
            lines = text.splitlines()
        else:
            for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
                lines += block.replace("\\\n", " ").splitlines()
        for chunk in spans + lines:
            for seg in _segments(chunk):
                words = _words(seg.strip())
                if words is not None:
                    found.append((where, words))
    return found


def resolve(words: list[str]) -> str | None:
    """None when the words name an existing (sub-)command, else what is wrong."""
    cmd = typer.main.get_command(app)
    path = ["cohort"]
    for w in words:
        if not hasattr(cmd, "commands") or w.startswith("-") or not re.match(r"^[a-z][a-z0-9-|]*$", w):
            return None
        names = w.split("|") if ALTERNATIVES.match(w) else [w]
        for name in names:
            if name not in cmd.commands:
                return f"`{' '.join(path)}` has no sub-command `{name}` (has: {', '.join(sorted(cmd.commands))})"
        cmd = cmd.commands[names[0]]
        path.append(names[0])
    return None


def test_the_walk_finds_commands():
    found = commands()
    assert len(found) > 20
    assert any(w[:2] == ["worker", "export-model"] for _, w in found)


@pytest.mark.parametrize("where,words", commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_documented_command_exists(where, words):
    problem = resolve(words)
    assert problem is None, f"{where}: `cohort {' '.join(words)}`: {problem}"


def test_a_missing_command_is_caught():
    assert resolve(["model", "export", "DIR"]) is not None
    assert resolve(["worker", "export-model", "/tmp/tiny"]) is None
