"""No import circles between product modules, and few imports deferred into functions.

Read with ``ast`` from every module of every product package (``tests/test_floors.py``'s
``PACKAGES``: a folder at the repository root with an ``__init__.py``), nothing is imported.

What counts as an edge of the module graph (``a -> b``: module ``a`` imports module ``b``):

* every **module-level** import: at the top of the file, and inside a module-level ``if``,
  ``try`` or class body;
* **``if TYPE_CHECKING:`` imports count too.** They do not run, so they cannot break an import,
  but a circle only for the type checker is still two modules that each need the other to be
  understood: the circle of concepts is what the rule is about (``bench/soak_stats.py`` once
  named ``bench.soak.SoakConfig`` this way while ``bench/soak.py`` imported the stats);
* **function-level imports do not count** as edges: they are deferred on purpose (a heavy
  library such as torch or matplotlib that only one path needs, and a process start that must
  stay quick), and a deferred import back up the graph is how a circle would be hidden instead of
  removed — so their number is capped instead (``MAX_FUNCTION_IMPORTS``, ``*/cli.py`` aside:
  a command's module defers each command's imports to keep ``cohort --help`` fast).

``import a.b.c`` is an edge to ``a.b.c`` (not to the packages ``a`` and ``a.b`` it also runs);
``from a.b import c`` is an edge to ``a.b.c`` when that is a module, else to ``a.b``; relative
imports are resolved against the importing module.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

from tests.test_floors import PACKAGES, ROOT

# The target (function-level imports outside the command modules).
MAX_FUNCTION_IMPORTS = 40
# Every product package the rules were written for; a package added later is read as well.
NAMED = {"cohort", "procstack", "taskq", "batcher", "predictor", "deployer", "workers", "learning", "gateway",
         "bench", "offline", "launch"}

Imp = ast.Import | ast.ImportFrom


def module_files(root: Path, packages: list[str]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of ``packages`` under ``root``."""
    out = {}
    for pkg in packages:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


@cache
def _parse(path: Path) -> ast.Module:
    """Each module parsed once per test process (three tests read every one)."""
    return ast.parse(path.read_text(), str(path))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def split_imports(tree: ast.Module) -> tuple[list[Imp], list[Imp]]:
    """(module-level imports, ``if TYPE_CHECKING:`` ones included; imports inside a function, at
    any depth: a method's too)."""
    module: list[Imp] = []
    deferred: list[Imp] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                module.append(node)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                deferred.extend(n for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom)))
            else:  # the bodies of a module-level if / try / with / for / match / class run at import
                for child in ast.iter_child_nodes(node):  # (an ``if TYPE_CHECKING:`` body too: see above)
                    if isinstance(child, (ast.excepthandler, ast.match_case)):
                        visit(child.body)
                for field in ("body", "orelse", "finalbody"):
                    block = getattr(node, field, None)
                    if isinstance(block, list):
                        visit(block)

    visit(tree.body)
    return module, deferred


def _targets(name: str, path: Path, node: Imp, modules: dict[str, Path]) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (a.name for a in node.names if a.name in modules)
        return
    if node.level:
        base = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    for alias in node.names:
        if f"{source}.{alias.name}" in modules:
            yield f"{source}.{alias.name}"
        elif source in modules:
            yield source


def import_graph(root: Path, packages: list[str]) -> dict[str, set[str]]:
    """Module -> the product modules it imports at module level (see the module docstring)."""
    modules = module_files(root, packages)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        top, _ = split_imports(_parse(path))
        graph[name] = {t for node in top for t in _targets(name, path, node, modules) if t != name}
    return graph


def circular_parts(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module: each reaches each other one."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    parts: list[list[str]] = []

    def connect(v: str) -> None:  # Tarjan; the product graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                parts.append(sorted(part))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return sorted(parts)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle per strongly connected part of the graph, as a path ``[a, b, ..., a]``: the
    shortest through the part's first module (the part may hold more modules than that circle)."""
    return [_circle_through(part[0], set(part), graph) for part in circular_parts(graph)]


def _circle_through(start: str, part: set[str], graph: dict[str, set[str]]) -> list[str]:
    """The shortest path from ``start`` back to itself inside its strongly connected part."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & part):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in no circle")  # unreachable: the part is strongly connected


def function_level_imports(root: Path, packages: list[str]) -> list[str]:
    """``path:line: import ...`` for each import inside a function, command modules aside."""
    out = []
    for path in module_files(root, packages).values():
        if path.name == "cli.py":
            continue
        _, deferred = split_imports(_parse(path))
        out += [f"{path.relative_to(root)}:{n.lineno}: {ast.unparse(n)}" for n in deferred]
    return sorted(out)


@pytest.mark.slow  # 1.80 s of real work on the 2-core VM: `make test` runs it, the fast loop does not
def test_every_named_package_is_read() -> None:
    assert NAMED <= set(PACKAGES)
    graph = import_graph(ROOT, PACKAGES)
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)
    assert sum("cohort.settings" in targets for targets in graph.values()) > 10  # the reader sees edges


def test_no_import_circles() -> None:
    graph = import_graph(ROOT, PACKAGES)
    found = [f"{' -> '.join(_circle_through(part[0], set(part), graph))}  (in circles with each other: "
             f"{', '.join(part)}; their edges: {', '.join(f'{a} -> {b}' for a in part for b in sorted(graph[a] & set(part)))})"
             for part in circular_parts(graph)]
    assert not found, "import circles (module-level imports, TYPE_CHECKING ones included):\n" + "\n".join(found)


def test_few_imports_are_deferred_into_functions() -> None:
    found = function_level_imports(ROOT, PACKAGES)
    assert len(found) <= MAX_FUNCTION_IMPORTS, (
        f"{len(found)} function-level imports outside */cli.py (at most {MAX_FUNCTION_IMPORTS}):\n" + "\n".join(found))


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def test_the_reader_finds_circles_through_type_checking_and_relative_imports(tmp_path: Path) -> None:
    _write(tmp_path, {
        "p/__init__.py": "",
        "p/a.py": "from p import b\n",
        "p/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import C\n",
        "p/c.py": "try:\n    import p.a\nexcept ImportError:\n    pass\n",
        "p/d.py": "def f():\n    from p import e\n    import os\n",
        "p/e.py": "from p.d import f\n",
        "q/__init__.py": "",
        "q/cli.py": "def main():\n    import p.a\n",
    })
    graph = import_graph(tmp_path, ["p", "q"])
    assert graph["p.a"] == {"p.b"} and graph["p.b"] == {"p.c"} and graph["p.c"] == {"p.a"}
    assert graph["p.d"] == set() and graph["p.e"] == {"p.d"}  # d's import of e is deferred: no edge
    assert cycles(graph) == [["p.a", "p.b", "p.c", "p.a"]] and circular_parts(graph) == [["p.a", "p.b", "p.c"]]
    assert function_level_imports(tmp_path, ["p", "q"]) == ["p/d.py:2: from p import e", "p/d.py:3: import os"]


def test_a_two_module_circle_is_named_both_ways(tmp_path: Path) -> None:
    _write(tmp_path, {"p/__init__.py": "", "p/x.py": "import p.y\n", "p/y.py": "from p.x import X\n"})
    assert cycles(import_graph(tmp_path, ["p"])) == [["p.x", "p.y", "p.x"]]
