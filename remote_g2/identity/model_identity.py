"""A model's identity for the layout fingerprint: a digest of the weights the engine loaded, not their name.

Two workers exchange blocks only when their fingerprints' model parts agree,
and that part must change whenever K or V for the same tokens would:

* **the weights' bytes** — every byte of every checkpoint file the engine
  loads (:func:`checkpoint_files` picks them the way engines do;
  :func:`weights_digest` digests them, once per file version, through
  :mod:`remote_g2.identity.file_digest`'s on-disk cache). New weights under an old
  path get a new identity; the same weights under another path (or a copy,
  or a hub snapshot) get the same one;
* **the options that change K or V** — the model config as the engine read
  it, dtype, quantisation, load format and whatever else the adapter names:
  a canonical JSON of them, digested with the weights.

A ``model_id`` in the fingerprint reads ``LABEL#IDENTITY``. ``LABEL`` is for
people (the path or hub id a worker was started with) and takes no part in
matching; ``IDENTITY`` is ``w-`` and 32 hex digits for loaded weights, or
``o-`` and 32 hex digits for an operator's ``model_id`` override (the
override's text with the options: the operator then answers for changing it
whenever the weights change). :func:`identity_of` gives the part compared.

Weights an engine generates rather than loads (vLLM's ``load_format=dummy``,
random init) have no identity: adapters do not share them at all. Such an
instance may still register, for operators to see, under ``none-KIND-`` and
a random tail (:func:`unshared_model_id`): an identity nothing else has.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from remote_g2.errors import ConfigError
from remote_g2.identity.file_digest import ALGORITHM, DigestCache, FileDigest, Progress, default_cache, digest_file

__all__ = ["WEIGHT_GROUPS", "WeightsDigest", "checkpoint_files", "identity_of", "label_of", "model_id_for",
           "model_label", "override_model_id", "unshared_kind", "unshared_model_id", "weights_digest"]

log = logging.getLogger("remote_g2.identity.model_identity")

_MAX_MODEL_ID = 256  # LayoutFingerprint.model_id
_ID_HEX = 32  # 128 bits
_UNSHARED = "none-"  # the identity part of an instance that has none (unshared_model_id)

#: Checkpoint forms, in the order engines prefer them: the first group with files in a directory is what loads
#: (vLLM's default loader: safetensors, else ``.bin``, else ``.pt``). An index file goes with its group.
#: GGUF files and TensorRT engines count only where ``order`` names them.
WEIGHT_GROUPS: dict[str, tuple[str, ...]] = {
    "safetensors": ("*.safetensors", "*.safetensors.index.json"),
    "bin": ("*.bin", "pytorch_model*.bin.index.json", "*.bin.index.json"),
    "pt": ("*.pt", "*.pth", "*.pt.index.json"),
    "gguf": ("*.gguf",),
    "engine": ("*.engine",),  # built TensorRT engines
}
_DEFAULT_ORDER = ("safetensors", "bin", "pt")


@dataclass(frozen=True, slots=True)
class WeightsDigest:
    """The digest of a set of checkpoint files, and what it cost (for the start-up log and benchmarks)."""

    digest: str
    files: tuple[FileDigest, ...]
    seconds: float

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def bytes_read(self) -> int:
        return sum(f.size for f in self.files if not f.cached)

    def summary(self) -> str:
        cached = sum(1 for f in self.files if f.cached)
        return (f"{len(self.files)} files, {self.bytes / 1e9:.3f} GB, {cached} from the digest cache, "
                f"{self.bytes_read / 1e9:.3f} GB read in {self.seconds:.2f} s")


def checkpoint_files(path: str | os.PathLike[str], *, order: Sequence[str] = _DEFAULT_ORDER,
                     also: Iterable[str] = ()) -> list[Path]:
    """The files whose bytes are the weights at ``path``: the file itself, or a directory's checkpoint files.

    In a directory, the first of ``order``'s :data:`WEIGHT_GROUPS` with a
    file at the top level (engines glob the top level only) is taken whole,
    index included, with every file matching a pattern of ``also`` (e.g.
    ``config.json``, ``*.engine``, a remote-code model's ``*.py``). A file
    (a GGUF, a TensorRT engine) is itself. Raises ``ConfigError`` when there
    is nothing to digest: an identity of no bytes would match any weights.
    """
    p = Path(path)
    if p.is_file():
        return [p]
    if not p.is_dir():
        raise ConfigError(f"no checkpoint at {p}: not a file or directory")
    chosen: set[Path] = set()
    for group in order:
        found = {f for pattern in WEIGHT_GROUPS[group] for f in p.glob(pattern) if f.is_file()}
        if any(not f.name.endswith(".json") for f in found):
            chosen = found
            break
    if not chosen:
        raise ConfigError(f"no checkpoint files in {p} (looked for {', '.join(order)} files): nothing to identify "
                          "the weights by")
    chosen |= {f for pattern in also for f in p.glob(pattern) if f.is_file()}
    return sorted(chosen)


def weights_digest(files: Sequence[str | os.PathLike[str]], root: str | os.PathLike[str] | None = None, *,
                   cache: DigestCache | None | bool = True, threads: int | None = None,
                   algorithm: str = ALGORITHM, fresh_since_ns: int | None = None) -> WeightsDigest:
    """One digest of ``files``' bytes and names (relative to ``root``; their base names without one).

    Names count because a sharded checkpoint's files are told apart by name;
    where the files live does not. ``cache=True`` uses the node's
    :func:`~remote_g2.identity.file_digest.default_cache`; ``None``/``False`` reads every
    file. Files are read in ``threads`` threads (default: one per core, at
    most 4): hashing releases the GIL. A long read logs its progress every
    10 s (bytes read of the total, MB/s). ``fresh_since_ns``: where the
    cache cannot be trusted, take only entries read since (the engine's start).
    """
    if not files:
        raise ConfigError("no checkpoint files to digest")
    store = default_cache() if cache is True else (cache or None)
    names = [os.path.relpath(f, root) if root is not None else os.path.basename(f) for f in files]
    if len(set(names)) != len(names):
        raise ConfigError(f"checkpoint file names repeat: {sorted(names)}")
    t0 = time.perf_counter()
    workers = max(1, min(len(files), threads or min(4, len(os.sched_getaffinity(0)))))
    total = sum(os.path.getsize(f) for f in files)
    progress = Progress(f"{len(files)} checkpoint files in {root or os.path.dirname(os.fspath(files[0]))}", total)
    with ThreadPoolExecutor(workers, thread_name_prefix="remote-g2-digest") as pool:
        digests = list(pool.map(lambda f: digest_file(f, store, algorithm=algorithm, progress=progress,
                                                      fresh_since_ns=fresh_since_ns), files))
    h = hashlib.sha256(f"remote-g2 weights v1 {algorithm}\n".encode())
    for name, d in sorted(zip(names, digests)):
        h.update(json.dumps([name, d.size, d.digest]).encode() + b"\n")
    return WeightsDigest(h.hexdigest(), tuple(digests), time.perf_counter() - t0)


def _options_text(options: Mapping[str, Any]) -> str:
    return json.dumps(options, sort_keys=True, default=str, separators=(",", ":"))


def label_of(name: str) -> str:
    """A label that fits beside the identity: the name's tail when it is too long (a path's end tells most)."""
    room = _MAX_MODEL_ID - 3 - _ID_HEX - 1
    name = name.replace("#", "_")
    return name if len(name) <= room else "…" + name[-(room - 1):]


def model_id_for(label: str, weights: str, options: Mapping[str, Any]) -> str:
    """``LABEL#w-…``: the identity of weights whose :func:`weights_digest` is ``weights``, loaded with ``options``."""
    h = hashlib.sha256(f"remote-g2 model v1\n{weights}\n{_options_text(options)}".encode())
    return f"{label_of(label)}#w-{h.hexdigest()[:_ID_HEX]}"


def override_model_id(override: str, options: Mapping[str, Any]) -> str:
    """``OVERRIDE#o-…``: an operator's name for the weights, with the options; it must change when they do."""
    if not override.strip():
        raise ConfigError("model_id override is empty")
    h = hashlib.sha256(f"remote-g2 override v1\n{override}\n{_options_text(options)}".encode())
    return f"{label_of(override)}#o-{h.hexdigest()[:_ID_HEX]}"


def unshared_model_id(label: str, kind: str) -> str:
    """``LABEL#none-KIND-…``: the ``model_id`` an instance without an identity registers under, so that operators
    see it (``admin models``) and why (``kind``: generated, load_format, absent, changed, unreadable, ...). Its
    tail is random: no other registration's ever equals it, so its blocks match nobody's, nor anybody's its."""
    kind = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in kind)[:12] or "unknown"
    return f"{label_of(label)}#{_UNSHARED}{kind}-{secrets.token_hex(8)}"


def unshared_kind(model_id: str) -> str | None:
    """Why a registered instance has no identity (:func:`unshared_model_id`); None for one that has one."""
    identity = identity_of(model_id)
    if not identity.startswith(_UNSHARED):
        return None
    return identity[len(_UNSHARED):].rpartition("-")[0] or "unknown"


def identity_of(model_id: str) -> str:
    """The part of a fingerprint's ``model_id`` that matching compares: after the last ``#`` (all of it without one)."""
    return model_id.rpartition("#")[2]


def model_label(model_id: str) -> str | None:
    """The part of a fingerprint's ``model_id`` before its last ``#``, for people; None when there is none."""
    label, sep, _ = model_id.rpartition("#")
    return label if sep and label else None
