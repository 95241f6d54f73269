"""Every command and sub-command of `cohort` answers `--help`.

The tree is walked from the click command typer builds, so a command added anywhere (a new
sub-app, a new command in an existing one) is covered without touching this file. Help text is
rendered with rich markup, where a literal ``[...]`` in a help string can crash the page.
"""

from __future__ import annotations

from typing import Any

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from launch.cli import app


def command_paths(cmd: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The path of every command below ``cmd`` (``cmd`` itself included, as ``()``). Asked
    through ``list_commands``/``get_command``, as click itself does, so lazily built groups count."""
    out = [path]
    if hasattr(cmd, "list_commands"):  # a group (typer vendors its own click: no isinstance)
        ctx = cmd.context_class(cmd, info_name=path[-1] if path else "cohort")
        for name in cmd.list_commands(ctx):
            sub = cmd.get_command(ctx, name)
            assert sub is not None, f"cohort {' '.join(path)} lists {name!r} but cannot build it"
            out += command_paths(sub, (*path, name))
    return out


PATHS = command_paths(get_command(app))


def test_the_walk_finds_nested_commands() -> None:
    """The walk reaches the sub-apps' own commands, not only the top level."""
    assert ("bench", "sim") in PATHS and ("serve",) in PATHS and ("worker",) in PATHS
    assert len(PATHS) > 15


@pytest.mark.parametrize("path", PATHS, ids=lambda p: " ".join(p) or "cohort")
def test_help_answers(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(app, [*path, "--help"], catch_exceptions=True)
    assert result.exit_code == 0, f"cohort {' '.join(path)} --help: {result.exception!r}\n{result.output}"
    assert "Usage" in result.output
