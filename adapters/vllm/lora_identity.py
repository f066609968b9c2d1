"""A LoRA adapter's identity: the digest of the files vLLM loads for it, and the registry keys of its blocks.

vLLM hashes a LoRA request's blocks with ``("lora", name, path)``: an
adapter rewritten under the same path keeps its hashes, so without more the
KV of the old adapter would be read by instances running the new one. The
connector therefore keys such blocks by vLLM's hash *and* a digest of the
adapter's bytes (:func:`lora_block_keys`), in lookups, saves and the G2
pool alike; two different adapters under one name and path never match.

**What is digested** is what vLLM 0.32 reads to load an adapter
(``vllm/lora/peft_helper.py``, ``vllm/lora/lora_model.py``):
``adapter_config.json`` and the first of ``adapter_model.safetensors``,
``adapter_model.bin``, ``adapter_model.pt`` that is a file; plus the
instance's LoRA options that change K or V (``lora_dtype``,
``target_modules``, ``fully_sharded_loras``, ...: :func:`lora_options`).
A path vLLM would take for a hub id (not on this host's disk as given) has
no identity.

**The bytes digested are the bytes loaded.** vLLM loads an adapter when the
engine is asked to add it or first runs a request with it, and may load it
again after evicting it; none of that can happen before the connector's
scheduler exists (vLLM builds it before the engine takes any request). So an
adapter has an identity only when

* each file is read through one descriptor whose version — device, inode,
  size, ``mtime_ns``, ``ctime_ns`` — is the same before and after the read;
* every file, the adapter directory and every symbolic link met resolving
  their paths last changed at least :data:`SETTLE_S` before ``loaded_after``
  (the scheduler's start): whatever vLLM loaded since, before or after
  the digest, were these bytes as long as they stay unchanged;
* and they stay unchanged: :meth:`LoraIdentities.identity` stats them again
  (once per scheduler step) before a lookup or a save, and each worker
  stats them again after its forward, before it saves a block
  (:func:`files_unchanged`). An adapter whose files changed has no identity
  from then on, in this process: its blocks are neither looked up nor
  saved (one warning; ``remote_g2_vllm_lora_no_identity_total{reason}``).
  Restart the instance to share it again.

Limits, stated so no one relies on more: a change between a lookup and the
worker's (re)load of an adapter within the same step or two is seen only
at the next check (that request's forward may mix the two adapters'
bytes); a directory above the adapter replaced *before* the first request
with it is not seen. Timestamps must be trustworthy: on a filesystem whose
``ctime`` need not move on writes (FUSE object-store mounts, 9p, NFS
``nocto``: :func:`remote_g2.identity.mounts.untrusted_reason`) an adapter still gets
an identity, as the model does, with a warning that a change keeping size
and ``mtime`` would go unseen: roll adapters out to new paths there.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from prometheus_client import Counter

from remote_g2.errors import ConfigError
from remote_g2.identity.file_digest import ALGORITHM, hasher_for
from remote_g2.identity.mounts import untrusted_reason

__all__ = ["CONFIG_FILE", "DIGESTED", "NO_IDENTITY", "SETTLE_S", "WEIGHT_FILES", "LoraIdentities", "LoraIdentity",
           "PathVersion", "changed_adapters", "digest_adapter", "files_unchanged", "lora_block_keys", "lora_options"]

log = logging.getLogger("remote_g2.adapters.vllm")

CONFIG_FILE = "adapter_config.json"
#: vLLM 0.32's weight files, in the order it looks for them: it loads the first that is a file.
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin", "adapter_model.pt")
#: A file must have last changed this long before the scheduler started: file timestamps come from a coarse
#: clock (a tick behind ``time.time``), and a network filesystem's from another host's.
SETTLE_S = 1.0
#: LoRA options that change how much vLLM can hold, not what it computes.
_CAPACITY_OPTIONS = frozenset({"max_loras", "max_cpu_loras"})
_KEY_DOMAIN = b"remote-g2/lora\0"
_CHUNK = 8 << 20
_MAX_LINKS = 40  # as the kernel's ELOOP limit

#: On prometheus_client's default registry, as the model identity's gauge: vLLM's ``/metrics`` shows them where
#: the connector's scheduler process serves it.
DIGESTED = Counter("remote_g2_vllm_lora_digested", "LoRA adapters this vLLM scheduler digested and shares")
NO_IDENTITY = Counter("remote_g2_vllm_lora_no_identity", "LoRA adapters whose KV blocks this vLLM scheduler neither "
                      "looks up nor saves, by reason (unreadable: no local files to digest; changed: files changed "
                      "after the engine started or after they were digested)", ["reason"])


class PathVersion(NamedTuple):
    """One path's version as ``stat`` (``lstat`` for a link) gives it; what a re-check compares."""

    path: str
    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int
    link: bool = False

    @classmethod
    def of(cls, path: str, st: os.stat_result, link: bool = False) -> PathVersion:
        return cls(path, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, link)


def _stat_now(v: PathVersion) -> PathVersion | None:
    try:
        return PathVersion.of(v.path, os.lstat(v.path) if v.link else os.stat(v.path), v.link)
    except OSError:
        return None


def files_unchanged(versions: Sequence[PathVersion]) -> bool:
    """Whether every path still has the version recorded (a stat each; a path gone is a change)."""
    return all(_stat_now(v) == v for v in versions)


def changed_adapters(save_lora: Sequence[str], lora_files: Mapping[str, Sequence[PathVersion]]) -> set[str]:
    """A worker's check after its forward: the adapters (keys, hex) of this step's saves whose files changed.

    ``save_lora[i]`` names save block i's adapter ("": none); ``lora_files`` each adapter's file versions as
    digested. An adapter named without versions counts as changed: nothing unchecked is saved.
    """
    return {k for k in set(save_lora) - {""} if k not in lora_files or not files_unchanged(lora_files[k])}


@dataclass(frozen=True, slots=True)
class LoraIdentity:
    """An adapter (``name``, ``path`` as the request gives them) and its key, or why it has none.

    ``key``: 32 bytes, the digest of the adapter's files and the instance's LoRA options (None: no identity,
    ``why_not`` says why, ``reason`` names it for the metric: ``unreadable`` or ``changed``); ``versions``:
    what :func:`files_unchanged` checks.
    """

    name: str
    path: str
    key: bytes | None
    why_not: str = ""
    reason: str = ""
    versions: tuple[PathVersion, ...] = ()
    nbytes: int = 0
    caveat: str = ""  # an identity given on a filesystem whose stat cannot prove every change (logged)


def lora_options(lora_config: Any) -> dict[str, Any]:
    """The instance's LoRA options that may change K or V (all of vLLM's ``LoRAConfig`` but its capacities)."""
    if lora_config is None:
        return {}
    if dataclasses.is_dataclass(lora_config):
        items = {f.name: getattr(lora_config, f.name, None) for f in dataclasses.fields(lora_config)}
    else:
        items = dict(vars(lora_config))
    return {k: str(v) for k, v in sorted(items.items()) if k not in _CAPACITY_OPTIONS and not k.startswith("_")}


def lora_block_keys(key: bytes, hashes: Sequence[bytes]) -> list[bytes]:
    """The registry's key of each block of a LoRA request: vLLM's hash bound to the adapter's key (32 bytes)."""
    return [hashlib.sha256(_KEY_DOMAIN + key + bytes(h)).digest() for h in hashes]


def _local_dir(path: str) -> str | None:
    """The adapter directory as vLLM resolves ``path`` (``get_adapter_absolute_path``); None for a hub id."""
    if os.path.isabs(path):
        return path
    if path.startswith("~"):
        return os.path.expanduser(path)
    if os.path.exists(path):
        return os.path.abspath(path)
    return None


def _links_on(path: str, seen: list[str]) -> None:
    """Append to ``seen`` every symbolic link met resolving ``path`` (absolute), those in link targets too."""
    cur = "/"
    for part in path.split("/"):
        if part in ("", "."):
            continue
        nxt = os.path.join(cur, part)
        if os.path.islink(nxt):
            if len(seen) >= _MAX_LINKS:
                raise OSError(f"more than {_MAX_LINKS} symbolic links resolving {path}")
            seen.append(nxt)
            _links_on(os.path.join(cur, os.readlink(nxt)), seen)
        cur = os.path.realpath(nxt)


def _read(path: str) -> tuple[str, PathVersion]:
    """The digest of the file at ``path`` and its version, the same before and after the read."""
    fd = os.open(path, os.O_RDONLY)
    try:
        before = PathVersion.of(path, os.fstat(fd))
        h = hasher_for(ALGORITHM)()
        while chunk := os.read(fd, _CHUNK):
            h.update(chunk)
        after = PathVersion.of(path, os.fstat(fd))
    finally:
        os.close(fd)
    if before != after:
        raise ConfigError(f"{path} changed while it was read")
    return h.hexdigest(), before


def digest_adapter(name: str, path: str, options: Mapping[str, Any], *, loaded_after_ns: int) -> LoraIdentity:
    """The identity of the adapter vLLM loads for ``LoRARequest(name, _, path)``, or why it has none (see module)."""
    where = _local_dir(path)
    if where is None:
        return LoraIdentity(name, path, None, f"{path!r} is not a path on this host (a hub id is resolved by vLLM "
                                              "when it loads it: remote-g2 cannot tell which revision)",
                            "unreadable")
    try:
        weights = next((w for w in WEIGHT_FILES if os.path.isfile(os.path.join(where, w))), None)
        if weights is None:
            return LoraIdentity(name, path, None, f"no {' / '.join(WEIGHT_FILES)} in {where}", "unreadable")
        files = [os.path.join(where, f) for f in (CONFIG_FILE, weights)]
        links: list[str] = []
        for f in files:  # the directory's path, and a file that is itself a link (a hub cache's snapshot)
            _links_on(f, links)
        versions = [PathVersion.of(p, os.lstat(p), True) for p in dict.fromkeys(links)]
        versions.append(PathVersion.of(where, os.stat(where)))
        h = hashlib.sha256(f"remote-g2 lora v1 {ALGORITHM}\n".encode())
        h.update(json.dumps(dict(options), sort_keys=True).encode() + b"\n")
        nbytes = 0
        for f in files:
            digest, version = _read(f)
            h.update(json.dumps([os.path.basename(f), version.size, digest]).encode() + b"\n")
            versions.append(version)
            nbytes += version.size
        if not files_unchanged(versions):  # the directory or a link moved while the files were read
            raise ConfigError(f"{where} changed while it was digested")
    except (OSError, ConfigError) as e:
        return LoraIdentity(name, path, None, f"cannot digest {where}: {e}", "unreadable")
    settled = loaded_after_ns - int(SETTLE_S * 1e9)
    late = [v.path for v in versions if max(v.mtime_ns, v.ctime_ns) >= settled]
    if late:
        return LoraIdentity(name, path, None, f"{', '.join(late)} changed after the engine started (or within "
                                              f"{SETTLE_S:g} s before): vLLM may have loaded other bytes than "
                                              "these; restart the instance to share this adapter", "changed")
    caveat = next((r for r in (untrusted_reason(os.path.realpath(v.path)) for v in versions if not v.link) if r), "")
    return LoraIdentity(name, path, h.digest(), versions=tuple(versions), nbytes=nbytes, caveat=caveat)


class LoraIdentities:
    """The adapters one scheduler has seen: each digested once, re-checked at most once a step, lost for good.

    ``loaded_after_ns`` (``time.time_ns()``): no adapter can have been loaded before it (the scheduler's start).
    """

    def __init__(self, options: Mapping[str, Any], *, loaded_after_ns: int | None = None,
                 clock: Callable[[], int] = time.time_ns) -> None:
        self._options = dict(options)
        self.loaded_after_ns = clock() if loaded_after_ns is None else loaded_after_ns
        self._known: dict[tuple[str, str], LoraIdentity] = {}
        self._checked: set[tuple[str, str]] = set()  # re-checked in this step

    def identity(self, name: str, path: str) -> LoraIdentity:
        """The adapter's identity now: digested on first sight, its files stat-checked once a step after that."""
        k = (name, path)
        ident = self._known.get(k)
        if ident is None:
            t0 = time.perf_counter()
            ident = self._known[k] = digest_adapter(name, path, self._options, loaded_after_ns=self.loaded_after_ns)
            self._checked.add(k)
            if ident.key is None:
                self._lost(ident)
            else:
                DIGESTED.inc()
                log.info("remote-g2: LoRA adapter %r (%s): key %s (%d bytes digested in %.3f s)", name, path,
                         ident.key.hex()[:16], ident.nbytes, time.perf_counter() - t0)
                if ident.caveat:
                    log.warning("remote-g2: LoRA adapter %r has an identity, but a change of its files that keeps "
                                "their size and mtime would go unseen: %s", name, ident.caveat)
        elif ident.key is not None and k not in self._checked:
            self._checked.add(k)
            if not files_unchanged(ident.versions):
                ident = self._known[k] = dataclasses.replace(
                    ident, key=None, reason="changed",
                    why_not="its files changed after they were digested: the engine may run either version; restart "
                            "the instance to share this adapter")
                self._lost(ident)
        return ident

    def new_step(self) -> None:
        """A new scheduler step: every adapter is stat-checked again at its next use."""
        self._checked.clear()

    def _lost(self, ident: LoraIdentity) -> None:
        NO_IDENTITY.labels(ident.reason).inc()
        log.warning("remote-g2: not sharing the KV blocks of LoRA adapter %r (%s): %s", ident.name, ident.path,
                    ident.why_not)

    def still_valid(self, ident: LoraIdentity) -> LoraIdentity | None:
        """``ident`` if its adapter still has that identity (re-checked as :meth:`identity` does), else None."""
        now = self.identity(ident.name, ident.path)
        return ident if now.key is not None and now.key == ident.key else None
