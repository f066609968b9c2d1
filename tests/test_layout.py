"""The package's shape, read from its source: dependencies point one way, and files stay small enough to read.

Directions (docs/architecture.md): the core (``remote_g2/``: protocol, RPC,
identity, memory, TP, the contracts and the adapter table) imports none of
the parts; ``registry/``, ``source/`` and ``target/`` import the core and
nothing from ``adapters/``; engines and transfers in ``adapters/`` wire the
parts together. Between any two packages (a sub-package, or a module at a
package's top level) imports go one way only: no cycle, not even one that only
type hints close. Imports are read with :mod:`ast`, including those inside
functions and under ``TYPE_CHECKING``.

Size: no source file outside ``tests/`` past 600 lines, no folder of more than
16 source files, and ``bench/`` runs as modules (``python -m bench....``)
without editing ``sys.path``.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: directory -> the package it installs as (pyproject.toml's wheel.packages)
PACKAGES = {"remote_g2": "remote_g2", "registry": "remote_g2.registry", "source": "remote_g2.source",
            "target": "remote_g2.target", "adapters": "remote_g2.adapters"}
PARTS = ("remote_g2.registry", "remote_g2.source", "remote_g2.target", "remote_g2.adapters")
#: Folders whose files are the project's code (``tests/`` has its own habits: long tables of cases).
CODE = ("remote_g2", "registry", "source", "target", "adapters", "bench", "examples", "tools")
MAX_LINES = 600
MAX_FILES_PER_FOLDER = 16
#: Which of the registry's packages each may import (registry/__init__.py).
REGISTRY_MAY_IMPORT = {
    "stores": set(),
    "client": {"stores"},
    "scoring": {"stores", "metrics"},
    "server": {"stores", "client", "scoring", "metrics"},
}


def _modules(directory: str, root: Path = ROOT) -> list[Path]:
    return sorted(p for p in (root / directory).rglob("*.py") if "__pycache__" not in p.parts)


def _imports(path: Path, directory: str, root: Path = ROOT) -> set[str]:
    """Every module ``path`` imports, as an absolute dotted name (relative imports resolved)."""
    package = PACKAGES[directory].split(".") + list(path.relative_to(root / directory).parent.parts)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)
    return found


def _module_name(path: Path, directory: str, root: Path = ROOT) -> str:
    parts = [PACKAGES[directory], *path.relative_to(root / directory).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str, known: set[str]) -> str:
    """The package ``module`` belongs to: its sub-package of a part or of the core, else the module itself.

    A part's sub-packages (``remote_g2.registry.stores``) and the core's (``remote_g2.rpc``) are units; a module
    at a package's top level (``remote_g2.errors``, ``remote_g2.registry.metrics``) is a unit of its own; the
    flat parts (``remote_g2.source``) are one unit each. An imported name is first cut to its module.
    """
    while module not in known and "." in module:
        module = module.rpartition(".")[0]
    parts = module.split(".")
    depth = 3 if len(parts) > 2 and parts[1] in ("registry", "adapters") else 2
    unit = ".".join(parts[:depth])
    if unit in known and unit != module and any(k.startswith(unit + ".") for k in known):
        return unit  # a package: every module inside it is this unit
    return unit if unit in known else module


def _import_graph(root: Path = ROOT) -> dict[str, dict[str, str]]:
    """unit -> {imported unit: one "file imports name" that shows the edge}."""
    files = {d: _modules(d, root) for d in PACKAGES if (root / d).is_dir()}
    known = {_module_name(p, d, root) for d, paths in files.items() for p in paths}
    graph: dict[str, dict[str, str]] = defaultdict(dict)
    for directory, paths in files.items():
        for path in paths:
            me = _unit(_module_name(path, directory, root), known)
            for name in sorted(_imports(path, directory, root)):
                if name.split(".")[0] != "remote_g2":
                    continue
                other = _unit(name, known)
                if other != me and other in known:
                    graph[me].setdefault(other, f"{path.relative_to(root)} imports {name}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """Every strongly connected set of more than one unit (Tarjan), each as the edges that close it."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                inside = set(members)
                found.append(sorted(graph[a][b] for a in inside for b in graph.get(a, {}) if b in inside))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _offending(directory: str, forbidden: tuple[str, ...], root: Path = ROOT) -> list[str]:
    out = []
    for path in _modules(directory, root):
        for name in sorted(_imports(path, directory, root)):
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                out.append(f"{path.relative_to(root)} imports {name}")
    return out


def test_the_core_imports_none_of_the_parts() -> None:
    assert _offending("remote_g2", PARTS) == []


@pytest.mark.parametrize("part", ["registry", "source", "target"])
def test_registry_source_and_target_import_nothing_from_adapters(part: str) -> None:
    assert _offending(part, ("remote_g2.adapters",)) == []


def test_the_import_reader_sees_relative_and_nested_imports(tmp_path: Path) -> None:
    """The check above can fail: a relative import of ``..adapters`` from ``target/`` is read as one."""
    (tmp_path / "target" / "sub").mkdir(parents=True)
    (tmp_path / "target" / "sub" / "probe.py").write_text(
        "def f():\n    from ...adapters import nixl_transfer\n    import remote_g2.adapters.host_pool\n"
        "from ..client import TargetClient\n")
    assert _offending("target", ("remote_g2.adapters",), tmp_path) == [
        "target/sub/probe.py imports remote_g2.adapters",
        "target/sub/probe.py imports remote_g2.adapters.host_pool",
        "target/sub/probe.py imports remote_g2.adapters.nixl_transfer",
    ]
    assert _offending("target", ("remote_g2.target.client",), tmp_path) == [
        "target/sub/probe.py imports remote_g2.target.client",
        "target/sub/probe.py imports remote_g2.target.client.TargetClient",
    ]


def test_every_file_of_the_target_side_reads_in_one_sitting() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in _modules("target")}
    assert max(sizes.values()) < 450, sizes


def test_imports_between_packages_point_one_way() -> None:
    assert _cycles(_import_graph()) == []


def test_the_cycle_finder_sees_a_cycle_that_only_type_hints_close(tmp_path: Path) -> None:
    """The check above can fail: two sub-packages of the core that import each other, one under TYPE_CHECKING."""
    for sub, body in (("aa", "from ..bb.y import Y\n"),
                      ("bb", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..aa.x import X\n")):
        (tmp_path / "remote_g2" / sub).mkdir(parents=True)
        (tmp_path / "remote_g2" / sub / "__init__.py").write_text("")
        (tmp_path / "remote_g2" / sub / ("x.py" if sub == "aa" else "y.py")).write_text(body)
    (tmp_path / "remote_g2" / "errors.py").write_text("")
    assert _cycles(_import_graph(tmp_path)) == [["remote_g2/aa/x.py imports remote_g2.bb.y",
                                                 "remote_g2/bb/y.py imports remote_g2.aa.x"]]


def test_the_registry_packages_import_only_what_their_init_allows() -> None:
    graph = _import_graph()
    wrong = []
    for package, allowed in REGISTRY_MAY_IMPORT.items():
        for other, why in graph.get(f"remote_g2.registry.{package}", {}).items():
            if other.startswith("remote_g2.registry.") and other.split(".")[2] not in allowed:
                wrong.append(why)
    assert wrong == []


def _code_files() -> list[Path]:
    return [p for d in CODE if (ROOT / d).is_dir() for p in _modules(d)]


def test_no_source_file_outside_tests_holds_more_than_one_sitting() -> None:
    long = {str(p.relative_to(ROOT)): n for p in _code_files() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_no_folder_holds_more_than_a_handful_of_files() -> None:
    per_folder: dict[Path, int] = defaultdict(int)
    for p in _code_files():
        per_folder[p.parent] += 1
    crowded = {str(d.relative_to(ROOT)): n for d, n in per_folder.items() if n > MAX_FILES_PER_FOLDER}
    assert crowded == {}


def test_every_package_says_what_it_owns_and_what_it_may_import() -> None:
    silent = []
    for d in PACKAGES:
        for init in (ROOT / d).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text())) or ""
            if "may import" not in doc.lower():
                silent.append(str(init.relative_to(ROOT)))
    assert sorted(silent) == []


def _edits_sys_path(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
                and node.value.id == "sys"):
            lines.append(node.lineno)
    return lines


def test_benches_run_as_modules_without_editing_sys_path() -> None:
    edits = {str(p.relative_to(ROOT)): n for p in _modules("bench") if (n := _edits_sys_path(p))}
    assert edits == {}
    assert (ROOT / "bench" / "__init__.py").is_file()
