"""Proof that the bytes digested are the bytes an engine loaded: nothing on their path changed after it started.

An engine loads its weights at start-up and remote-g2 digests them later
(vLLM 0.32: after ``load_model``, in ``register_kv_caches``). A symlink
flipped (``/models/current -> v2``), a file rewritten in place, or a hub
``refs/main`` moved by another process in between would give the old weights
the new ones' identity. So an identity is given only when nothing that decides
which bytes a path names changed after a **start mark**: a moment before the
load began.

**The mark** (:func:`start_mark`) is the moment the engine's configuration was
made, recorded by the vLLM plugin in the process that makes it and handed to
the engine's processes (:class:`LoadSnapshot`, through
:data:`SNAPSHOT_ENV`); a process that has no such snapshot from itself or an
ancestor takes its own start time (``/proc/self/stat``, floored to the clock
tick and to the boot time's second: never later than the real start).
Timestamps are coarse: a change up to :data:`MARGIN_NS` before the mark
counts as after it.

**The check** (:func:`changed_after`) refuses when, after the mark,

* any digested file's ``ctime`` or ``mtime`` moved (a write in place, a
  rename onto it, a ``touch``),
* any symlink met resolving a digested file or the model directory was
  created or replaced (``ln -sfn`` makes a new link: a new ``ctime``),
* the model directory itself changed (a file added, removed or renamed in it),
* the hub ref the snapshot resolved (``refs/main``) was written, or names
  another commit than the snapshot did,
* a digested file is not the one the snapshot recorded under its name
  (another size, ``mtime``, ``ctime`` or inode), or was not there then: the
  snapshot records the model directory's files (up to
  :data:`MAX_SNAPSHOT_BYTES` of them: it travels in the environment),
  which also catches, on filesystems whose ``ctime`` cannot be trusted, a
  file whose size changed with its ``mtime`` preserved,
* any directory on the model's path names another inode than it did when the
  snapshot was taken (``mv v2 current``); without a snapshot this last one
  cannot be checked for directories above the model directory, since their
  ``ctime`` moves whenever any of their entries changes.

``ctime`` is what makes this a proof: the kernel sets it on every change and
no user can set it back. On filesystems where that fails
(:mod:`remote_g2.identity.mounts`: FUSE object stores, 9p, NFS ``nocto``) the check
still catches a change of size, ``mtime`` or inode, but not an object
replaced by another of the same size and ``mtime``: callers say so.
A wall clock stepped back after the mark also hides changes.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import stat
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["MARGIN_NS", "MAX_SNAPSHOT_BYTES", "SNAPSHOT_ENV", "FileStamp", "LoadSnapshot", "PathLink", "StartMark", "changed_after", "hub_repo_dir",
           "path_chain", "process_start_ns", "start_mark"]

SNAPSHOT_ENV = "REMOTE_G2_LOAD_SNAPSHOT"
#: A change this close before the mark counts as after it: file timestamps come from a clock that may lag the
#: wall clock by a tick (up to 10 ms at HZ=100).
MARGIN_NS = 50_000_000
_MAX_LINKS = 40  # as the kernel's ELOOP limit
#: The most a snapshot's JSON may take with its files recorded (an environment string is limited to 128 KiB;
#: past this the files are left out and only the ctime checks and the path's chain remain).
MAX_SNAPSHOT_BYTES = 32 << 10
_COMMIT = re.compile(r"[0-9a-f]{40}")


def _stat_fields(pid: int | str) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2:].split()  # the name may hold spaces and parentheses


def process_start_ticks(pid: int | str = "self") -> int:
    """A process's start time in clock ticks since boot (field 22 of ``/proc/PID/stat``)."""
    return int(_stat_fields(pid)[19])


def _parent(pid: int | str) -> int:
    return int(_stat_fields(pid)[1])


def process_start_ns(pid: int | str = "self") -> int:
    """When a process started, in wall-clock ns, floored: never later than the real start.

    ``/proc/stat``'s ``btime`` is the boot time truncated to the second and
    the start is counted in ticks, so ``btime + ticks / CLK_TCK`` is at most
    the real start time.
    """
    with open("/proc/stat") as f:
        btime = next(int(line.split()[1]) for line in f if line.startswith("btime "))
    hz = os.sysconf("SC_CLK_TCK")
    return btime * 1_000_000_000 + process_start_ticks(pid) * 1_000_000_000 // hz


@dataclass(frozen=True, slots=True)
class PathLink:
    """One object met resolving a path: a directory, a file, a symlink (and its text) or a missing name."""

    path: str
    kind: str  # "dir", "file", "link", "other", "missing"
    dev: int
    ino: int
    ctime_ns: int
    mtime_ns: int
    target: str = ""

    def same_object(self, other: PathLink) -> bool:
        return (self.path, self.kind, self.dev, self.ino, self.target) == \
            (other.path, other.kind, other.dev, other.ino, other.target)


def _kind(mode: int) -> str:
    return ("dir" if stat.S_ISDIR(mode) else "file" if stat.S_ISREG(mode) else "link" if stat.S_ISLNK(mode)
            else "other")


def path_chain(path: str | os.PathLike[str]) -> tuple[list[PathLink], str]:
    """Every object the kernel meets resolving ``path`` (each component, each symlink and what it names), and the
    real path: ``realpath``'s walk, with ``lstat`` of every step recorded."""
    pending = [c for c in os.fspath(os.path.abspath(path)).split("/") if c]
    resolved, chain, links = "/", [], 0
    st = os.lstat("/")
    chain.append(PathLink("/", "dir", st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns))
    while pending:
        name = pending.pop(0)
        if name == ".":
            continue
        if name == "..":
            resolved = os.path.dirname(resolved) or "/"
            continue
        here = os.path.join(resolved, name)
        try:
            st = os.lstat(here)
        except FileNotFoundError:
            chain.append(PathLink(here, "missing", 0, 0, 0, 0))
            return chain, os.path.join(here, *pending)
        kind = _kind(st.st_mode)
        target = os.readlink(here) if kind == "link" else ""
        chain.append(PathLink(here, kind, st.st_dev, st.st_ino, st.st_ctime_ns, st.st_mtime_ns, target))
        if kind == "link":
            links += 1
            if links > _MAX_LINKS:
                raise OSError(f"too many symlinks resolving {path}")
            if target.startswith("/"):
                resolved = "/"
            pending[:0] = [c for c in target.split("/") if c]
        else:
            resolved = here
    return chain, resolved


def hub_repo_dir(model: str, cache_dir: str | None = None) -> Path:
    """The hub cache's folder of repository ``model`` (``models--org--name``), in ``cache_dir`` or the default."""
    if cache_dir is None:
        try:
            from huggingface_hub.constants import HF_HUB_CACHE

            cache_dir = HF_HUB_CACHE
        except ImportError:  # pragma: no cover - vLLM brings huggingface_hub
            cache_dir = os.path.join(os.path.expanduser("~"), ".cache", "huggingface", "hub")
    return Path(cache_dir) / ("models--" + model.replace("/", "--"))


@dataclass(frozen=True, slots=True)
class FileStamp:
    """One file of the model directory as the snapshot saw it (``os.stat``, through symlinks)."""

    name: str
    size: int
    mtime_ns: int
    ctime_ns: int
    dev: int
    ino: int

    @classmethod
    def of(cls, name: str, st: os.stat_result) -> FileStamp:
        return cls(name, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino)


def _file_stamps(where: str) -> tuple[FileStamp, ...]:
    if os.path.isfile(where):
        return (FileStamp.of(os.path.basename(where), os.stat(where)),)
    stamps = []
    with os.scandir(where) as entries:
        for e in entries:
            try:
                if e.is_file():
                    stamps.append(FileStamp.of(e.name, e.stat()))
            except OSError:
                continue
    return tuple(sorted(stamps, key=lambda s: s.name))


@dataclass(frozen=True, slots=True)
class LoadSnapshot:
    """What a model's path named when the engine's configuration was made (before the load), and when.

    ``model``/``revision``/``download_dir`` are the engine's settings; ``pid``
    and ``pid_start`` the process that took it (only it and its descendants
    use it). ``where`` is the path the weights are read from: the local path,
    or for a hub model its snapshot folder for ``hub_commit``, the commit
    the ref file ``hub_ref`` named then (None: not in the local cache yet);
    ``chain`` is its :func:`path_chain`; ``files`` the files directly in it
    (``files_recorded``: False when they were too many to travel).
    """

    taken_ns: int
    pid: int
    pid_start: int
    model: str
    revision: str | None
    download_dir: str | None
    where: str | None
    chain: tuple[PathLink, ...]
    hub_ref: str | None = None
    hub_commit: str | None = None
    files: tuple[FileStamp, ...] = ()
    files_recorded: bool = False

    @classmethod
    def take(cls, model: str, revision: str | None = None, download_dir: str | None = None) -> LoadSnapshot:
        """The snapshot now. The time is read first: whatever is recorded is at least as new as the mark."""
        taken = time.time_ns()
        hub_ref = hub_commit = None
        where: str | None = model
        if not os.path.exists(model):
            repo = hub_repo_dir(model, download_dir)
            if revision is not None and _COMMIT.fullmatch(revision):
                hub_commit = revision
            else:
                hub_ref = str(repo / "refs" / (revision or "main"))
                try:
                    hub_commit = Path(hub_ref).read_text().strip() or None
                except OSError:
                    hub_commit = None
            where = str(repo / "snapshots" / hub_commit) if hub_commit else None
        chain = tuple(path_chain(where)[0]) if where else ()
        snap = cls(taken, os.getpid(), process_start_ticks(), model, revision, download_dir, where, chain, hub_ref,
                   hub_commit)
        if where and os.path.exists(where):
            with_files = dataclasses.replace(snap, files=_file_stamps(where), files_recorded=True)
            if len(with_files.to_json()) <= MAX_SNAPSHOT_BYTES:
                return with_files
        return snap

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LoadSnapshot:
        raw = json.loads(text)
        raw["chain"] = tuple(PathLink(**link) for link in raw["chain"])
        raw["files"] = tuple(FileStamp(**f) for f in raw.get("files", ()))
        return cls(**raw)

    def publish(self) -> None:
        """Hand this snapshot to the processes this one starts from now on (they inherit the environment)."""
        os.environ[SNAPSHOT_ENV] = self.to_json()

    @classmethod
    def inherited(cls, model: str, revision: str | None) -> LoadSnapshot | None:
        """The snapshot this process or an ancestor published for ``model`` at ``revision``, or None.

        Refused when it is for another model, or when the process that took it
        is not this one or an ancestor (an environment copied into an
        unrelated process, a pid reused): then the caller falls back to its own
        start time.
        """
        text = os.environ.get(SNAPSHOT_ENV)
        if not text:
            return None
        try:
            snap = cls.from_json(text)
        except (ValueError, TypeError, KeyError):
            return None
        if (snap.model, snap.revision) != (model, revision):
            return None
        pid: int = os.getpid()
        for _ in range(64):
            try:
                if pid == snap.pid:
                    return snap if process_start_ticks(pid) == snap.pid_start else None
                if pid <= 1:
                    return None
                pid = _parent(pid)
            except (OSError, ValueError, IndexError):
                return None
        return None


@dataclass(frozen=True, slots=True)
class StartMark:
    """The moment before the load from which any change counts (``ns``), and what it is, for the log."""

    ns: int
    what: str


def start_mark(snapshot: LoadSnapshot | None) -> StartMark:
    """The snapshot's time when there is one, else this process's start (see the module docstring)."""
    if snapshot is not None:
        return StartMark(snapshot.taken_ns, "the engine's configuration was made")
    return StartMark(process_start_ns(), "this process started")


def _stamp(ns: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ns / 1e9)) + f".{ns % 1_000_000_000 // 1_000_000:03d}Z"


def _newer(link: PathLink, since_ns: int) -> bool:
    return max(link.ctime_ns, link.mtime_ns) >= since_ns


def _chain_changed(chain: list[PathLink], since: int, when: str) -> str | None:
    """Why one resolved path (its links, then what it names) is not as it was before ``since``; None if it is."""
    for link in chain:
        if link.kind == "missing":
            return f"{link.path} is gone"
        if link.kind == "link" and _newer(link, since):
            return f"the symlink {link.path} -> {link.target} was made {when}"
    last = chain[-1]
    if _newer(last, since):
        return f"{last.path} changed {when} (at {_stamp(max(last.ctime_ns, last.mtime_ns))})"
    return None


def changed_after(mark: StartMark, files: Iterable[str | os.PathLike[str]], model_dir: str | os.PathLike[str],
                  snapshot: LoadSnapshot | None = None) -> str | None:
    """Why what ``files`` and ``model_dir`` name may not be what was loaded after ``mark``, or None.

    See the module docstring for what is checked. Call it after the files
    were digested: a None then proves the bytes read are the bytes as they
    were at the mark.
    """
    since = mark.ns - MARGIN_NS
    when = f"after {mark.what} ({_stamp(mark.ns)})"
    try:
        dir_chain, _ = path_chain(model_dir)
        for chain in (dir_chain, *(path_chain(f)[0] for f in files)):
            why = _chain_changed(chain, since, when)
            if why:
                return why
        if snapshot is not None:
            if snapshot.hub_ref is not None:
                why = _hub_ref_changed(snapshot, since, when)
                if why:
                    return why
            if snapshot.where is not None:
                now, _ = path_chain(snapshot.where)
                for before, after in zip(snapshot.chain, now):
                    if not before.same_object(after):
                        return f"{before.path} names another {after.kind} than when {mark.what}"
                if len(now) != len(snapshot.chain):
                    return f"{snapshot.model} resolves through other paths than when {mark.what}"
            why = _files_changed(snapshot, files, mark)
            if why:
                return why
    except OSError as e:
        return f"cannot check what the model's path named {when}: {e}"
    return None


def _files_changed(snapshot: LoadSnapshot, files: Iterable[str | os.PathLike[str]], mark: StartMark) -> str | None:
    """Why a digested file in the snapshot's folder is not the file it recorded under that name, or None."""
    if not snapshot.files_recorded or snapshot.where is None:
        return None
    recorded = {f.name: f for f in snapshot.files}
    folder = os.path.abspath(snapshot.where)
    single = os.path.isfile(folder)
    for f in files:
        path = os.path.abspath(f)
        if single:
            name = os.path.basename(path) if path == folder else None
        else:
            name = os.path.relpath(path, folder) if os.path.dirname(path) == folder else None
        if name is None:
            continue  # not directly in the folder (an hf_overrides file elsewhere): the ctime checks cover it
        if name not in recorded:
            return f"{path} was not there when {mark.what}"
        if FileStamp.of(name, os.stat(path)) != recorded[name]:
            return f"{path} is not the file it was when {mark.what} (size, mtime, ctime or inode differ)"
    return None


def _hub_ref_changed(snapshot: LoadSnapshot, since: int, when: str) -> str | None:
    assert snapshot.hub_ref is not None
    try:
        st = os.lstat(snapshot.hub_ref)
        commit = Path(snapshot.hub_ref).read_text().strip()
    except FileNotFoundError:
        return f"the hub ref {snapshot.hub_ref} is gone"
    if snapshot.hub_commit is None:
        return (f"the hub ref {snapshot.hub_ref} was written {when} (a first download, or another process): the "
                "revision loaded is not known; the next start has an identity")
    if commit != snapshot.hub_commit or max(st.st_ctime_ns, st.st_mtime_ns) >= since:
        return f"the hub ref {snapshot.hub_ref} was written {when} (now {commit}, was {snapshot.hub_commit})"
    return None
