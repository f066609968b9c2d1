"""The package's shape, read from its source: dependencies point one way, and files stay small enough to read.

Directions (docs/architecture.md): the core (``remote_g2/``: wire, RPC,
contracts, the adapter table) imports none of the parts; ``registry/``,
``source/`` and ``target/`` import the core and nothing from ``adapters/``;
engines and transfers in ``adapters/`` wire the parts together. Imports are
read with :mod:`ast`, including those inside functions.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: directory -> the package it installs as (pyproject.toml's wheel.packages)
PACKAGES = {"remote_g2": "remote_g2", "registry": "remote_g2.registry", "source": "remote_g2.source",
            "target": "remote_g2.target", "adapters": "remote_g2.adapters"}
PARTS = ("remote_g2.registry", "remote_g2.source", "remote_g2.target", "remote_g2.adapters")


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
