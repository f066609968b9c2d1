"""Digests of large files (model checkpoints), computed once per file version and remembered on disk.

A model's identity is a digest of every byte of its weights
(:mod:`remote_g2.model_identity`), and a checkpoint runs to tens of GB, so
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

**Trust.** The cache directory (``$REMOTE_G2_DIGEST_CACHE_DIR``, default
``$XDG_CACHE_HOME/remote-g2/file-digests``, i.e. ``~/.cache/...``) must be
owned by this user and closed to group and others (it is created ``0700``):
anyone who can write an entry could make new weights pass for old ones. A
directory that fails the check, cannot be created, or is set to the empty
string turns the cache off (one warning); digests are then computed every
time, and stay correct.

**Concurrency.** The processes of one node that need the same file's digest
take an advisory lock per entry (``flock``), so one of them reads the file
and the others wait and take its entry.

The hash is BLAKE3 (:data:`ALGORITHM`; measured against SHA-256 and xxh3 in
``bench/bench_weight_digest.py``, figures in ``docs/benchmarks.md``). Every
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
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from remote_g2.errors import ConfigError

__all__ = ["ALGORITHM", "CACHE_DIR_ENV", "RACY_WINDOW_S", "DigestCache", "FileDigest", "default_cache",
           "digest_file", "hasher_for"]

log = logging.getLogger("remote_g2.file_digest")

ALGORITHM = "blake3"
CACHE_DIR_ENV = "REMOTE_G2_DIGEST_CACHE_DIR"
#: A file whose mtime or ctime is this close to the moment it was read is not cached (see the module docstring).
RACY_WINDOW_S = 2.0
_ENTRY_FORMAT = 1
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
    """

    def __init__(self, directory: str | os.PathLike[str], *, racy_window_s: float = RACY_WINDOW_S) -> None:
        self.directory = Path(directory)
        self.racy_window_s = racy_window_s
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

    def get(self, version: FileVersion, algorithm: str) -> str | None:
        """The cached digest of exactly this file version, or None (no entry, another version, or unreadable)."""
        entry = self._entry_path(version.path)
        try:
            raw = json.loads(entry.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            log.warning("digest cache entry %s is unreadable (%s): ignored", entry, e)
            return None
        want = self._key(version, algorithm)
        if not isinstance(raw, dict) or set(raw) != set(want) | {"digest", "check"}:
            log.warning("digest cache entry %s has unexpected fields: ignored", entry)
            return None
        digest, check = raw.pop("digest"), raw.pop("check")
        if raw != want:
            return None  # another version of the file (or another algorithm): a miss, not an error
        if not (isinstance(digest, str) and 16 <= len(digest) <= 128 and all(c in "0123456789abcdef" for c in digest)
                and check == self._check({**want, "digest": digest})):
            log.warning("digest cache entry %s fails its check: ignored", entry)
            return None
        return digest

    def put(self, version: FileVersion, algorithm: str, digest: str) -> bool:
        """Remember ``digest`` for ``version``; False (nothing written) when the file changed too recently."""
        newest_s = max(version.mtime_ns, version.ctime_ns) / 1e9
        if time.time() - newest_s < self.racy_window_s:
            log.debug("%s changed %.2f s ago: its digest is not cached", version.path, time.time() - newest_s)
            return False
        fields = {**self._key(version, algorithm), "digest": digest}
        entry = self._entry_path(version.path)
        tmp = entry.with_name(f"{entry.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({**fields, "check": self._check(fields)}, sort_keys=True))
        os.replace(tmp, entry)
        return True

    def lock(self, real: str) -> _EntryLock:
        """An exclusive advisory lock on ``real``'s entry, held while its file is read (``with cache.lock(p):``)."""
        return _EntryLock(self._entry_path(real).with_suffix(".lock"))


class _EntryLock:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._fd = -1

    def __enter__(self) -> _EntryLock:
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)


_default: tuple[str, DigestCache | None] | None = None


def default_cache() -> DigestCache | None:
    """The node's cache (``$REMOTE_G2_DIGEST_CACHE_DIR``, else ``~/.cache/remote-g2/file-digests``), or None when off.

    Off when the variable is set to the empty string, or when the directory
    cannot be created or is not this user's alone (one warning says why).
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
            log.warning("weight digests are not cached (%s): every start reads the checkpoint again", e)
    _default = (configured, cache)
    return cache


def _read_digest(fd: int, algorithm: str) -> str:
    h = hasher_for(algorithm)()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while True:
        n = os.readv(fd, [view])
        if not n:
            return h.hexdigest()
        h.update(view[:n])


def digest_file(path: str | os.PathLike[str], cache: DigestCache | None = None, *,
                algorithm: str = ALGORITHM) -> FileDigest:
    """The digest of every byte of the file at ``path``, from ``cache`` when it holds this exact version.

    The file is read through one descriptor and its version taken from that
    descriptor before and after the read; a file that changed while it was
    read is read again (up to three times, then ``ConfigError``: weights
    still being written have no identity yet).
    """
    real = os.path.realpath(path)
    t0 = time.perf_counter()
    fd = os.open(real, os.O_RDONLY)
    try:
        version = FileVersion.of(real, os.fstat(fd))
        if cache is not None:
            try:
                hit = cache.get(version, algorithm)
                if hit is not None:
                    return FileDigest(real, version.size, algorithm, hit, True, time.perf_counter() - t0)
                with cache.lock(real):
                    hit = cache.get(version, algorithm)  # another process may have read it while we waited
                    if hit is not None:
                        return FileDigest(real, version.size, algorithm, hit, True, time.perf_counter() - t0)
                    digest, version = _stable_digest(fd, real, version, algorithm)
                    cache.put(version, algorithm, digest)
                return FileDigest(real, version.size, algorithm, digest, False, time.perf_counter() - t0)
            except OSError as e:  # a full or read-only cache volume costs the cache, never the digest
                log.warning("digest cache %s failed (%s): digesting %s without it", cache.directory, e, real)
        digest, version = _stable_digest(fd, real, version, algorithm)
    finally:
        os.close(fd)
    return FileDigest(real, version.size, algorithm, digest, False, time.perf_counter() - t0)


def _stable_digest(fd: int, real: str, version: FileVersion, algorithm: str) -> tuple[str, FileVersion]:
    for _ in range(_MAX_ATTEMPTS):
        os.lseek(fd, 0, os.SEEK_SET)
        digest = _read_digest(fd, algorithm)
        after = FileVersion.of(real, os.fstat(fd))
        if after == version:
            return digest, version
        version = after
    raise ConfigError(f"{real} kept changing while it was read ({_MAX_ATTEMPTS} times): weights still being "
                      "written have no identity yet")
