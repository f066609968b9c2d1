"""The two sides of ``bench.compare``: a commit checked out, installed and checked, ready to run benches.

A ``Side`` is one thing to measure: its role (``base`` or ``head``), the
revision asked for and its sha, the tree whose benches run (cwd
too), the venv and the python that runs them, the environment variables added
for it, HEAD's uncommitted files, how it was built (reused or not, seconds,
every command) and where its python imported the project from.

* ``build_side`` checks a commit out with ``git worktree add --detach`` at
  ``<work_dir>/<sha>/src`` and makes ``<work_dir>/<sha>/venv``: a bare venv
  whose ``.pth`` (``SHARED_PTH``) appends the site-packages of the venv running
  this script (``SharedVenv``: torch, NIXL, mpi4py, ... are shared, not
  downloaded again; a directory a ``.pth`` adds is not scanned for ``.pth``
  files, so this checkout's editable install stays out), with the files of the
  ``mpich`` wheel outside site-packages linked in, and the commit installed
  editable into it, its C++ extensions built from its own sources. Every
  build command is logged to ``<work_dir>/<sha>/build.log``. A worktree at
  that sha whose venv holds the stamp file (``STAMP``, naming the sha and the
  shared venv) is reused as it is. Each shared venv gets a side venv of its
  own (``venv`` for ``.venv``, ``venv-vllm`` for ``.venv-vllm``:
  ``SharedVenv.side_venv_name``).
* ``current_side`` is this checkout as it is, uncommitted changes included
  (and listed), run by this script's python.
* Either way, ``check_imports`` imports every module of ``remote_g2``,
  ``source``, ``registry``, ``target`` and ``adapters`` (and remote_g2's C++
  extensions) with the side's python and raises ``CompareError`` when any
  comes from outside the side's tree or venv.

``CompareError`` means a side could not be built or checked; nothing was
measured. ``log`` writes progress to stderr; ``clean_env`` is the environment
every side's commands run in.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import REPO

SHARED_PTH = "remote_g2_compare_shared.pth"
STAMP = ".remote-g2-compare-installed"
CHECKED_PACKAGES = ("remote_g2", "source", "registry", "target", "adapters")
IMPORT_CHECK = """
import importlib, importlib.machinery, json, pathlib, sys
for name in ("remote_g2", "source", "registry", "target", "adapters",
             "remote_g2.registry", "remote_g2.source", "remote_g2.target", "remote_g2.adapters"):
    importlib.import_module(name)
import remote_g2
for d in map(pathlib.Path, remote_g2.__path__):
    for f in d.glob("_*"):
        if any(f.name.endswith(s) for s in importlib.machinery.EXTENSION_SUFFIXES):
            importlib.import_module("remote_g2." + f.name.split(".")[0])
roots = set(sys.argv[1:])
print(json.dumps({name: getattr(m, "__file__", None) for name, m in sorted(sys.modules.items())
                  if name.split(".")[0] in roots}))
"""


class CompareError(RuntimeError):
    """A side could not be built or checked; nothing was measured."""


def log(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


def clean_env(overrides: dict[str, str] | None = None) -> dict[str, str]:
    """This environment without what would point a side's python at another tree, plus ``overrides``."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    return {**env, **(overrides or {})}


# ----------------------------------------------------------------------------------------- git


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True,
                          timeout=300).stdout.strip()


def resolve_sha(rev: str) -> str:
    try:
        return git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError as e:
        raise CompareError(f"{rev!r} is not a commit here: {e.stderr.strip()}") from e


def describe(sha: str) -> dict[str, str]:
    return {"describe": git("describe", "--always", "--tags", "--abbrev=7", sha),
            "subject": git("log", "-1", "--format=%s", sha)}


def uncommitted_files() -> list[str]:
    return [line for line in git("status", "--porcelain").splitlines() if line]


def worktree_at(tree: Path, sha: str) -> bool:
    if not (tree / ".git").exists():
        return False
    try:
        return git("rev-parse", "HEAD", cwd=tree) == sha
    except subprocess.CalledProcessError:
        return False


def add_worktree(tree: Path, sha: str) -> None:
    if tree.exists():
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True, timeout=300)
        shutil.rmtree(tree, ignore_errors=True)
    git("worktree", "prune")
    tree.parent.mkdir(parents=True, exist_ok=True)
    git("worktree", "add", "--detach", str(tree), sha)


# ----------------------------------------------------------------------------------------- sides


@dataclass(frozen=True)
class SharedVenv:
    """The venv running this script: its site-packages and ``mpich`` files go into every built side's venv."""

    prefix: Path
    site_dirs: tuple[Path, ...]

    @classmethod
    def current(cls) -> SharedVenv:
        if sys.prefix == sys.base_prefix:
            raise CompareError(f"run this with the project's venv python (.venv/bin/python), not {sys.executable}")
        dirs = dict.fromkeys(Path(sysconfig.get_path(k)) for k in ("purelib", "platlib"))
        return cls(Path(sys.prefix), tuple(d for d in dirs if d.is_dir()))

    def side_venv_name(self) -> str:
        """The name of a built side's venv beside its worktree, by the venv it shares: ``venv`` for ``.venv``,
        ``venv-vllm`` for ``.venv-vllm`` (the vLLM suite's), so each shared venv has a side venv of its own."""
        tail = self.prefix.name.lstrip(".").removeprefix("venv").lstrip("-")
        return f"venv-{tail}" if tail else "venv"


@dataclass
class Side:
    role: str
    rev: str
    sha: str
    tree: Path
    venv: Path
    python: Path
    env: dict[str, str]
    uncommitted: list[str] = field(default_factory=list)
    build: dict[str, Any] = field(default_factory=dict)
    imports: dict[str, str | None] = field(default_factory=dict)

    def record(self) -> dict[str, Any]:
        return {"rev": self.rev, "sha": self.sha, **describe(self.sha), "tree": str(self.tree),
                "python": str(self.python), "env": self.env, "has_uncommitted_changes": bool(self.uncommitted),
                "uncommitted": self.uncommitted, "build": self.build, "imports": self.imports}


def _run_logged(cmd: list[str], log_path: Path, commands: list[list[str]], timeout_s: float) -> None:
    commands.append(cmd)
    with log_path.open("a") as out:
        out.write(f"$ {shlex.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=clean_env(),
                                  timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise CompareError(f"`{shlex.join(cmd)}` took more than {timeout_s:g} s; {log_path}") from e
    if proc.returncode:
        tail = log_path.read_text()[-3000:]
        raise CompareError(f"`{shlex.join(cmd)}` failed ({proc.returncode}); {log_path}:\n{tail}")


def make_venv(venv: Path, shared: SharedVenv, log_path: Path, commands: list[list[str]], timeout_s: float) -> None:
    """A bare venv that sees ``shared``'s site-packages after its own, with the ``mpich`` wheel's files linked in."""
    shutil.rmtree(venv, ignore_errors=True)
    _run_logged([sys.executable, "-m", "venv", "--without-pip", str(venv)], log_path, commands, timeout_s)
    site = Path(_venv_purelib(venv))
    (site / SHARED_PTH).write_text("".join(f"{d}\n" for d in shared.site_dirs))
    link_dist_files("mpich", shared, venv)


def _venv_purelib(venv: Path) -> str:
    cmd = [str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]
    return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=60).stdout.strip()


def link_dist_files(dist_name: str, shared: SharedVenv, venv: Path) -> list[Path]:
    """Link the files ``dist_name`` installed outside site-packages (``bin/mpiexec``, ``lib/libmpi.so``, ...).

    The benches start ``Path(sys.executable).parent / "mpiexec"``, and mpi4py
    looks for ``libmpi`` under ``sys.exec_prefix/lib``: both must be in the new venv.
    """
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return []
    linked = []
    for f in dist.files or ():
        src = Path(os.path.normpath(dist.locate_file(f)))
        if any(src.is_relative_to(d) for d in shared.site_dirs) or not src.is_relative_to(shared.prefix):
            continue
        dst = venv / src.relative_to(shared.prefix)
        if dst.exists() or dst.is_symlink():
            continue
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
        linked.append(dst)
    return linked


def check_imports(python: Path, allowed: Sequence[Path], work: Path) -> dict[str, str | None]:
    """Where ``python`` imports the project's packages from; every file must lie under ``allowed``."""
    proc = subprocess.run([str(python), "-I", "-c", IMPORT_CHECK, *CHECKED_PACKAGES], cwd=work,
                          capture_output=True, text=True, env=clean_env(), timeout=300)
    if proc.returncode:
        raise CompareError(f"{python} cannot import the project:\n{proc.stderr[-3000:]}")
    files: dict[str, str | None] = json.loads(proc.stdout)
    roots = [p.resolve() for p in allowed]
    stray = {name: f for name, f in files.items() if f and not any(Path(f).resolve().is_relative_to(r) for r in roots)}
    if stray:
        lines = "\n".join(f"  {name}: {f}" for name, f in stray.items())
        raise CompareError(f"{python} imports modules from outside {', '.join(map(str, roots))}:\n{lines}")
    return files


def build_side(role: str, rev: str, work_dir: Path, shared: SharedVenv, env: dict[str, str],
               timeout_s: float) -> Side:
    """Check out ``rev`` at ``work_dir/<sha>/src`` with its own venv ``<sha>/venv`` and install it, or reuse both."""
    sha = resolve_sha(rev)
    root = work_dir / sha
    tree, venv = root / "src", root / shared.side_venv_name()
    stamp = venv / STAMP
    stamp_text = f"{sha}\n{shared.prefix}\n"
    commands: list[list[str]] = []
    t0 = time.monotonic()
    reused = worktree_at(tree, sha) and stamp.exists() and stamp.read_text() == stamp_text
    if reused:
        log(f"reusing {role.upper()} {sha[:7]} in {root}")
    else:
        log(f"building {role.upper()} {sha[:7]} in {root} (worktree, venv, C++ extensions)")
        root.mkdir(parents=True, exist_ok=True)
        log_path = root / "build.log"
        log_path.write_text("")
        if not worktree_at(tree, sha):
            commands.append(["git", "worktree", "add", "--detach", str(tree), sha])
            add_worktree(tree, sha)
        make_venv(venv, shared, log_path, commands, timeout_s)
        _run_logged([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                     "-e", str(tree)], log_path, commands, timeout_s)
        stamp.write_text(stamp_text)
        log(f"built {role.upper()} {sha[:7]} in {time.monotonic() - t0:.1f} s")
    python = venv / "bin" / "python"
    imports = check_imports(python, (tree, venv), root)
    log(f"{role.upper()} {sha[:7]} imports {', '.join(CHECKED_PACKAGES)} from {tree}")
    return Side(role, rev, sha, tree, venv, python, env, build={
        "reused": reused, "seconds": round(time.monotonic() - t0, 1), "commands": commands}, imports=imports)


def current_side(shared: SharedVenv, env: dict[str, str]) -> Side:
    """This checkout, run by this script's python (its editable install must be this checkout)."""
    sha = resolve_sha("HEAD")
    python = Path(sys.executable)
    imports = check_imports(python, (REPO, shared.prefix), REPO)
    dirty = uncommitted_files()
    if dirty:
        log(f"HEAD {sha[:7]} has {len(dirty)} uncommitted change(s): measuring the working tree")
    return Side("head", "HEAD (working tree)", sha, REPO, shared.prefix, python, env, uncommitted=dirty,
                build={"reused": True, "seconds": 0.0, "commands": []}, imports=imports)
