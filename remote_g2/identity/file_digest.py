"""Digests of large files (model checkpoints), computed once per file version and remembered on disk.

A model's identity is a digest of every byte of its weights
(:mod:`remote_g2.identity.model_identity`), and a checkpoint runs to tens of GB, so
each file is read once per *version* and its digest kept in a small cache
directory that every process on the node shares: a restart, a second
instance, or the TP ranks and the scheduler of one instance pay nothing.

**The cache rule.** An entry is trusted only when the file, as the digest
is asked for, has the same real path, device, inode, size, ``mtime_ns`` *and*
``ctime_ns`` the entry records. ``ctime`` is there because ``mtime`` can be
set back (``cp -p``, ``rsync -t``, ``touch -r`` onto the same inode), while
``ctime`` moves on every write and no user can set it. A file replaced by
rename (a new inode) or rewritten in place (a new ``ctime``) is therefore
digested again. A file changed within :data:`RACY_WINDOW_S` of being read
is digested but not cached: timestamps are coarser than writes, so an entry
for it could not tell a later rewrite within the same tick (git's "racy"
rule). An entry that does not parse, has the wrong fields or types, or whose
own check digest does not match, is ignored and rewritten, never trusted.

**Filesystems whose ctime cannot be trusted** (:mod:`remote_g2.identity.mounts`:
FUSE object-store mounts, 9p, NFS ``nocto``) cannot prove a change, so no
entry stands for a version there: an entry of such a file is taken only when
its read *began after* ``fresh_since_ns`` (the engine's start mark, which
its scheduler and TP ranks share: another of them read it since, as fresh as
reading it again; without one, the moment this process asked). Every start
therefore reads those files, once per node.

**Trust.** The cache directory (``$REMOTE_G2_DIGEST_CACHE_DIR``, default
``$XDG_CACHE_HOME/remote-g2/file-digests``, i.e. ``~/.cache/...``) must be
owned by this user and closed to group and others (it is created ``0700``):
anyone who can write an entry could make new weights pass for old ones. A
directory that fails the check or cannot be created or written falls back to
the node's memory (``/dev/shm/remote-g2-UID``, else the temporary
directory's, checked alike; lost at reboot), so the processes of a node
still read each file once; set to the empty string, the cache is off and
every process reads every file.

**Concurrency.** The processes of one node that need the same file's digest
take an advisory lock per entry (``flock``), so one of them reads the file
and the others wait and take its entry. The wait is bounded by progress,
not by size: the reader writes how far it got into the lock file, and a
waiter that sees no progress for :data:`LOCK_STALL_S` (a reader hung on a
dead NFS server, a process stopped while holding it) stops waiting and reads
the file itself (one warning). A long first read logs its progress
(:class:`Progress`).

The hash is BLAKE3 (:data:`ALGORITHM`; measured against SHA-256 and xxh3 in
``bench/identity/bench_weight_digest.py``, figures in ``docs/benchmarks.md``). Every
worker of a fleet must use the same one, so it is not a setting.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from remote_g2.identity import mounts
from remote_g2.errors import ConfigError

__all__ = ["ALGORITHM", "CACHE_DIR_ENV", "LOCK_STALL_S", "RACY_WINDOW_S", "DigestCache", "FileDigest", "Progress",
           "default_cache", "digest_file", "hasher_for", "node_cache"]

log = logging.getLogger("remote_g2.identity.file_digest")

ALGORITHM = "blake3"
CACHE_DIR_ENV = "REMOTE_G2_DIGEST_CACHE_DIR"
#: A file whose mtime or ctime is this close to the moment it was read is not cached (see the module docstring).
RACY_WINDOW_S = 2.0
#: How long a process waits on another's read of the same file without seeing it progress (then reads it itself).
LOCK_STALL_S = 30.0
_LOCK_POLL_S = 0.05
_ENTRY_FORMAT = 2  # 2: read_started_ns (entries of format 1 are read again)
_CHUNK = 8 << 20
_MAX_ATTEMPTS = 3  # reads of a file that keeps changing under us before giving up


class _Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


def hasher_for(algorithm: str) -> Callable[[], _Hasher]:
    """A factory of incremental hashers for ``algorithm`` (``blake3``, ``sha256``; ``xxh3_128`` for benchmarks)."""
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3
    if algorithm == "xxh3_128":
        import xxhash

        return xxhash.xxh3_128
    if algorithm in hashlib.algorithms_available:
        return lambda: hashlib.new(algorithm)
    raise ConfigError(f"unknown digest algorithm {algorithm!r}")


@dataclass(frozen=True, slots=True)
class FileVersion:
    """What identifies one version of a file for the cache (see the module docstring)."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, path: str, st: os.stat_result) -> FileVersion:
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class FileDigest:
    """One file's digest; ``cached`` tells whether it came from the cache (nothing was read)."""

    path: str
    size: int
    algorithm: str
    digest: str
    cached: bool
    seconds: float = 0.0


class DigestCache:
    """The on-disk cache of file digests in ``directory`` (see the module docstring for the rule).

    ``racy_window_s``: files changed this recently are not cached (tests pass 0).
    ``lock_stall_s``: how long a waiter tolerates another reader making no progress.
    """

    def __init__(self, directory: str | os.PathLike[str], *, racy_window_s: float = RACY_WINDOW_S,
                 lock_stall_s: float = LOCK_STALL_S) -> None:
        self.directory = Path(directory)
        self.racy_window_s = racy_window_s
        self.lock_stall_s = lock_stall_s
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.stat(self.directory)
        if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise ConfigError(f"digest cache {self.directory} is not this user's alone (owner uid {st.st_uid}, mode "
                              f"{stat.filemode(st.st_mode)}): its entries could be forged; not using it")

    def _entry_path(self, real: str) -> Path:
        return self.directory / (hashlib.sha256(real.encode()).hexdigest()[:40] + ".json")

    @staticmethod
    def _check(fields: dict[str, Any]) -> str:
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()

    @staticmethod
    def _key(version: FileVersion, algorithm: str) -> dict[str, Any]:
        """What an entry must record to stand for ``version``'s digest by ``algorithm``."""
        return {"format": _ENTRY_FORMAT, **dataclasses.asdict(version), "algorithm": algorithm}

    def get(self, version: FileVersion, algorithm: str, *, read_since_ns: int | None = None) -> str | None:
        """The cached digest of exactly this file version, or None (no entry, another version, or unreadable).

        ``read_since_ns``: take only an entry whose read began at or after it
        (a file whose version cannot prove a change: see the module docstring).
        """
        entry = self._entry_path(version.path)
        try:
            raw = json.loads(entry.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("digest cache entry %s is unreadable (%s): ignored", entry, e)
            return None
        want = self._key(version, algorithm)
        if not isinstance(raw, dict) or set(raw) != set(want) | {"digest", "read_started_ns", "check"}:
            if not (isinstance(raw, dict) and raw.get("format") != _ENTRY_FORMAT):
                log.warning("digest cache entry %s has unexpected fields: ignored", entry)
            return None
        digest, started, check = raw.pop("digest"), raw.pop("read_started_ns"), raw.pop("check")
        if raw != want:
            return None  # another version of the file (or another algorithm): a miss, not an error
        if not (isinstance(digest, str) and 16 <= len(digest) <= 128 and all(c in "0123456789abcdef" for c in digest)
                and isinstance(started, int)
                and check == self._check({**want, "digest": digest, "read_started_ns": started})):
            log.warning("digest cache entry %s fails its check: ignored", entry)
            return None
        if read_since_ns is not None and started < read_since_ns:
            return None  # read before this process asked: where a change cannot be seen, not proof enough
        return digest

    def put(self, version: FileVersion, algorithm: str, digest: str, read_started_ns: int, *,
            racy_ok: bool = False) -> bool:
        """Remember ``digest`` for ``version``; False (nothing written) when the file changed too recently.

        ``racy_ok``: write it anyway (an entry only fresh readers take: see :meth:`get`'s ``read_since_ns``).
        """
        newest_s = max(version.mtime_ns, version.ctime_ns) / 1e9
        if not racy_ok and time.time() - newest_s < self.racy_window_s:
            log.debug("%s changed %.2f s ago: its digest is not cached", version.path, time.time() - newest_s)
            return False
        fields = {**self._key(version, algorithm), "digest": digest, "read_started_ns": read_started_ns}
        entry = self._entry_path(version.path)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({**fields, "check": self._check(fields)}, sort_keys=True))
        os.replace(tmp, entry)
        return True

    def lock(self, real: str) -> _EntryLock:
        """An exclusive advisory lock on ``real``'s entry, held while its file is read (``with cache.lock(p) as l:``).

        ``l.held`` is False when the holder made no progress for ``lock_stall_s``: the caller reads without it.
        """
        return _EntryLock(self._entry_path(real).with_suffix(".lock"), self.lock_stall_s)


class _EntryLock:
    """``flock`` on an entry's lock file, waited on for as long as its holder's reported progress moves."""

    def __init__(self, path: Path, stall_s: float) -> None:
        self._path = path
        self._stall_s = stall_s
        self._fd = -1
        self.held = False
        self._reported = 0.0

    def __enter__(self) -> _EntryLock:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        seen, since, warned = b"", time.monotonic(), False
        while True:
            try:
                fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                self.held = True
                os.ftruncate(self._fd, 0)
                return self
            except BlockingIOError:
                pass
            now_seen = os.pread(self._fd, 64, 0)
            if now_seen != seen:
                seen, since = now_seen, time.monotonic()
            elif time.monotonic() - since > self._stall_s:
                log.warning("another process has held the digest lock %s for %.0f s without progress (a hung read?): "
                            "reading the file here", self._path, self._stall_s)
                return self
            if not warned and time.monotonic() - since > 2.0:
                log.info("waiting for another process digesting the same file (lock %s)", self._path)
                warned = True
            time.sleep(_LOCK_POLL_S)

    def progress(self, done: int) -> None:
        """Tell waiters how far the read got (at most every 0.2 s)."""
        now = time.monotonic()
        if self.held and now - self._reported >= 0.2:
            self._reported = now
            os.pwrite(self._fd, f"{done:020d}".encode(), 0)

    def __exit__(self, *exc: object) -> None:
        if self.held:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


class Progress:
    """Bytes read for one digest job, summed over its threads, logged every ``every_s`` while it lasts.

    ``total`` is what may be read (every file's size); nothing is logged before ``every_s`` passed.
    """

    def __init__(self, what: str, total: int, every_s: float = 10.0) -> None:
        self.what = what
        self.total = total
        self.every_s = every_s
        self.done = 0
        self._lock = threading.Lock()
        self._t0 = self._last = time.monotonic()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._last < self.every_s:
                return
            self._last = now
            done, elapsed = self.done, now - self._t0
        log.info("digesting %s: %.2f of %.2f GB read in %.0f s (%.0f MB/s)", self.what, done / 1e9, self.total / 1e9,
                 elapsed, done / 1e6 / max(elapsed, 1e-9))


_default: tuple[str, DigestCache | None] | None = None
#: Where :func:`node_cache` looks, in order (memory first: it is gone at reboot, as nothing there need outlive one).
NODE_CACHE_BASES = ("/dev/shm", tempfile.gettempdir())
_node: DigestCache | None | bool = False  # False: not tried yet


def _private_dir(base: str) -> DigestCache:
    """A cache in ``base/remote-g2-UID``, made ``0700``; refused unless this user's alone (see DigestCache)."""
    d = os.path.join(base, f"remote-g2-{os.geteuid()}")
    os.makedirs(d, mode=0o700, exist_ok=True)
    return DigestCache(d)


def node_cache() -> DigestCache | None:
    """The node's fallback cache in memory (``/dev/shm/remote-g2-UID``, else the temporary directory's), or None."""
    global _node
    if _node is False:
        _node = None
        for base in NODE_CACHE_BASES:
            try:
                _node = _private_dir(base)
                break
            except (OSError, ConfigError) as e:
                log.warning("no node-wide digest cache in %s (%s)", base, e)
    return _node if isinstance(_node, DigestCache) else None


def default_cache() -> DigestCache | None:
    """The node's cache (``$REMOTE_G2_DIGEST_CACHE_DIR``, else ``~/.cache/remote-g2/file-digests``), or None when off.

    Off when the variable is set to the empty string. When the directory
    cannot be created or is not this user's alone, the node's memory
    (:func:`node_cache`) takes its place (one warning says why).
    """
    global _default
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured is None:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        configured = os.path.join(base, "remote-g2", "file-digests")
    if _default is not None and _default[0] == configured:
        return _default[1]
    cache: DigestCache | None = None
    if configured:
        try:
            cache = DigestCache(configured)
        except (OSError, ConfigError) as e:
            cache = node_cache()
            log.warning("weight digests are not cached in %s (%s): %s", configured, e,
                        f"using {cache.directory} (lost at reboot)" if cache is not None else
                        "every process reads the checkpoint")
    _default = (configured, cache)
    return cache


class _Counter:
    """What a read reports per chunk: to waiters on its lock, and to the job's :class:`Progress`."""

    def __init__(self, lock: _EntryLock, progress: Progress | None) -> None:
        self.lock, self.progress, self.done = lock, progress, 0

    def __call__(self, n: int) -> None:
        self.done += n
        self.lock.progress(self.done)
        if self.progress is not None:
            self.progress.add(n)


def _read_digest(fd: int, algorithm: str, on_bytes: Callable[[int], None] | None) -> str:
    h = hasher_for(algorithm)()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = os.readv(fd, [view])
        if not n:
            return h.hexdigest()
        h.update(view[:n])
        if on_bytes is not None:
            on_bytes(n)


def digest_file(path: str | os.PathLike[str], cache: DigestCache | None = None, *,
                algorithm: str = ALGORITHM, progress: Progress | None = None,
                fresh_since_ns: int | None = None) -> FileDigest:
    """The digest of every byte of the file at ``path``, from ``cache`` when it holds this exact version.

    The file is read through one descriptor and its version taken from that
    descriptor before and after the read; a file that changed while it was
    read is read again (up to three times, then ``ConfigError``: weights
    still being written have no identity yet). On a filesystem whose
    ``ctime`` cannot be trusted only an entry whose read began at or after
    ``fresh_since_ns`` (default: when this call began) is taken (module
    docstring). A cache that fails to write (a full or read-only volume)
    gives way to :func:`node_cache`, then to no cache.
    """
    asked = time.time_ns()
    real = os.path.realpath(path)
    untrusted = mounts.untrusted_reason(real)
    t0 = time.perf_counter()
    fd = os.open(real, os.O_RDONLY)
    try:
        version = FileVersion.of(real, os.fstat(fd))
        read_since = (asked if fresh_since_ns is None else fresh_since_ns) if untrusted else None
        tried: list[DigestCache] = []
        while cache is not None and cache not in tried:
            tried.append(cache)
            try:
                hit = cache.get(version, algorithm, read_since_ns=read_since)
                if hit is not None:
                    return FileDigest(real, version.size, algorithm, hit, True, time.perf_counter() - t0)
                with cache.lock(real) as lock:
                    if lock.held:  # another process may have read it while we waited
                        hit = cache.get(version, algorithm, read_since_ns=read_since)
                        if hit is not None:
                            return FileDigest(real, version.size, algorithm, hit, True, time.perf_counter() - t0)
                    started = time.time_ns()
                    digest, version = _stable_digest(fd, real, version, algorithm, _Counter(lock, progress))
                    if lock.held:
                        cache.put(version, algorithm, digest, started, racy_ok=untrusted is not None)
                return FileDigest(real, version.size, algorithm, digest, False, time.perf_counter() - t0)
            except OSError as e:  # a full or read-only cache volume costs the cache, never the digest
                fallback = node_cache()
                log.warning("digest cache %s failed (%s): %s", cache.directory, e,
                            f"using {fallback.directory}" if fallback is not None and fallback not in tried else
                            f"digesting {real} without it")
                cache = fallback
        digest, version = _stable_digest(fd, real, version, algorithm, progress.add if progress else None)
    finally:
        os.close(fd)
    return FileDigest(real, version.size, algorithm, digest, False, time.perf_counter() - t0)


def _stable_digest(fd: int, real: str, version: FileVersion, algorithm: str,
                   on_bytes: Callable[[int], None] | None = None) -> tuple[str, FileVersion]:
    for _ in range(_MAX_ATTEMPTS):
        os.lseek(fd, 0, os.SEEK_SET)
        digest = _read_digest(fd, algorithm, on_bytes)
        after = FileVersion.of(real, os.fstat(fd))
        if after == version:
            return digest, version
        version = after
    raise ConfigError(f"{real} kept changing while it was read ({_MAX_ATTEMPTS} times): weights still being "
                      "written have no identity yet")
