"""Which filesystem a file lives on, and whether its ``stat`` can prove that the file changed.

The digest cache (:mod:`remote_g2.identity.file_digest`) and the after-start check
(:mod:`remote_g2.identity.load_snapshot`) both rest on one kernel promise: every
write, rename or ``chmod`` moves a file's ``ctime`` to the current time,
and no user can set it back. Some filesystems do not keep that promise:

* **FUSE** (``fuse``, ``fuse.*``, ``fuseblk``): object-store mounts such as
  gcsfuse, s3fs, rclone or goofys report ``ctime`` equal to ``mtime`` (the
  object's metadata, which an uploader may preserve) and give inodes by
  path, so an object replaced by another of the same size and ``mtime``
  looks unchanged;
* **9p** (a VM's or container's host share): attributes come from another
  kernel, with caching the guest does not control;
* **NFS mounted with** ``nocto``: without close-to-open consistency, a
  ``stat`` after ``open`` may show attributes cached from before a change.

:func:`untrusted_reason` names such a filesystem (``None`` when ``ctime`` can
be trusted). The table is read from ``/proc/self/mountinfo``; tests pass
another text.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

__all__ = ["Mount", "MOUNTINFO", "mount_of", "parse_mountinfo", "untrusted_reason"]

MOUNTINFO = "/proc/self/mountinfo"
_UNTRUSTED_TYPES = frozenset({"fuse", "fuseblk", "9p"})


@dataclass(frozen=True, slots=True)
class Mount:
    """One line of mountinfo: where it is mounted, its filesystem type, source and options (mount and superblock)."""

    mount_point: str
    fs_type: str
    source: str
    options: frozenset[str]


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and len(field[i + 1:i + 4]) == 3 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def parse_mountinfo(text: str) -> list[Mount]:
    """The mounts of a mountinfo text, in its order (later lines mount over earlier ones); bad lines skipped."""
    mounts = []
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 2:
            continue
        # the per-mount options (field 6) and the superblock's (after the separator): NFS shows nocto in either
        opts = frozenset(fields[5].split(",")) | (frozenset(rest[2].split(",")) if len(rest) > 2 else frozenset())
        mounts.append(Mount(_unescape(fields[4]), rest[0], _unescape(rest[1]), opts))
    return mounts


def _read_mountinfo() -> str:
    try:
        with open(MOUNTINFO) as f:
            return f.read()
    except OSError:
        return ""


def mount_of(path: str, mountinfo: str | None = None) -> Mount | None:
    """The mount holding ``path`` (made real first): the last-mounted one whose mount point is its longest prefix."""
    real = os.path.realpath(path)
    best: Mount | None = None
    for m in parse_mountinfo(_read_mountinfo() if mountinfo is None else mountinfo):
        mp = m.mount_point.rstrip("/") or "/"
        inside = real == mp or real.startswith(mp + "/") or mp == "/"
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best


def untrusted_reason(path: str, mountinfo: str | None = None) -> str | None:
    """Why ``path``'s ``stat`` cannot prove a change (see the module docstring), or None when it can."""
    m = mount_of(path, mountinfo)
    if m is None:
        return None
    kind = m.fs_type
    if kind in _UNTRUSTED_TYPES or kind.startswith("fuse."):
        return (f"{path} is on {kind} ({m.source} at {m.mount_point}), whose ctime and inode need not change when "
                "the file does")
    if kind.startswith("nfs") and "nocto" in m.options:
        return f"{path} is on {kind} mounted nocto ({m.mount_point}): its attributes may be cached from before a change"
    return None
