"""The adapter table: every adapter remote-g2 ships, by kind and name, loaded only when chosen.

Three kinds of plug-in exist:

* ``"pool"`` — a rank's secondary (G2) pool, a :class:`~remote_g2.memory.secondary_pool.SecondaryPool`;
* ``"engine"`` — glue to an inference engine (reference engine, TensorRT-LLM, vLLM);
* ``"transfer"`` — the data plane (NIXL; a host-memory copy for tests on one box).

This file is the one place naming them. A registration stores only a module
path and an attribute name, so an adapter's module (and its heavy imports:
torch, nixl, vllm, ...) is imported the first time :func:`load_adapter` asks
for it, never when this module is imported.

Third-party adapters need no registration: a setting of the form
``"package.module:ClassName"`` names one directly, and ``load_adapter(kind,
name, module_path="package.module")`` loads ``package.module.<name>`` for a
name this file does not know (vLLM's ``kv_connector_module_path`` rule).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Any, overload

from remote_g2.errors import ConfigError

__all__ = ["ADAPTER_KINDS", "register_adapter", "load_adapter", "available_adapters"]

ADAPTER_KINDS: tuple[str, ...] = ("pool", "engine", "transfer")


@dataclass(frozen=True)
class _Entry:
    module_path: str
    attr: str


_lock = threading.Lock()
_entries: dict[tuple[str, str], _Entry] = {}


def register_adapter(kind: str, name: str, module_path: str, attr: str) -> None:
    """Name ``module_path:attr`` as adapter ``name`` of ``kind``; nothing is imported.

    Raises :class:`~remote_g2.errors.ConfigError` (like :func:`load_adapter`)
    for an unknown kind, an empty name or path, or a ``(kind, name)`` that is
    already registered (two adapters answering to one name would make a
    setting ambiguous).
    """
    _check_kind(kind)
    if not name or ":" in name or not module_path or not attr:
        raise ConfigError(f"bad adapter registration {kind}/{name!r} -> {module_path!r}:{attr!r}")
    with _lock:
        if (kind, name) in _entries:
            raise ConfigError(f"{kind} adapter {name!r} is already registered")
        _entries[(kind, name)] = _Entry(module_path, attr)


def load_adapter(kind: str, name: str, module_path: str | None = None) -> Any:
    """The adapter class for ``name`` of ``kind``, importing its module now.

    ``name`` is looked up in this order:

    1. a registered name (then ``module_path`` is ignored, as in vLLM);
    2. ``"package.module:Attr"`` — that attribute of that module;
    3. with ``module_path`` given: ``"package.module:Attr"`` loads that
       attribute, a plain ``"package.module"`` loads the attribute ``name``.

    Anything else — an unknown kind or name, a module that fails to import
    (e.g. its optional dependency is missing), a missing attribute — raises
    :class:`~remote_g2.errors.ConfigError` naming the known adapters of that
    kind, chained to the underlying error. Safe to call from any thread and
    any number of times (Python caches the import).
    """
    _check_kind(kind)
    with _lock:
        entry = _entries.get((kind, name))
    if entry is None:
        if ":" in name:
            entry = _parse_spec(kind, name)
        elif module_path:
            entry = _parse_spec(kind, module_path) if ":" in module_path else _Entry(module_path, name)
        else:
            raise ConfigError(f"unknown {kind} adapter {name!r}; known: {_known(kind)} "
                              "(or give 'package.module:ClassName')")
    try:
        module = importlib.import_module(entry.module_path)
    except ImportError as e:
        raise ConfigError(f"{kind} adapter {name!r}: cannot import {entry.module_path!r} ({e}); "
                          f"known: {_known(kind)}") from e
    try:
        return getattr(module, entry.attr)
    except AttributeError as e:
        raise ConfigError(f"{kind} adapter {name!r}: module {entry.module_path!r} has no "
                          f"attribute {entry.attr!r}; known: {_known(kind)}") from e


@overload
def available_adapters(kind: str) -> list[str]: ...
@overload
def available_adapters(kind: None = None) -> dict[str, list[str]]: ...


def available_adapters(kind: str | None = None) -> list[str] | dict[str, list[str]]:
    """Registered names: sorted for one ``kind``, or ``{kind: names}`` for every kind.

    Nothing is imported. :class:`~remote_g2.errors.ConfigError` for an unknown kind.
    """
    if kind is not None:
        _check_kind(kind)
        with _lock:
            return sorted(n for k, n in _entries if k == kind)
    return {k: available_adapters(k) for k in ADAPTER_KINDS}


def _check_kind(kind: str) -> None:
    if kind not in ADAPTER_KINDS:
        raise ConfigError(f"unknown adapter kind {kind!r}; kinds are {', '.join(ADAPTER_KINDS)}")


def _parse_spec(kind: str, spec: str) -> _Entry:
    module_path, _, attr = spec.partition(":")
    if not module_path or not attr or ":" in attr:
        raise ConfigError(f"bad {kind} adapter spec {spec!r}: expected 'package.module:ClassName'")
    return _Entry(module_path, attr)


def _known(kind: str) -> str:
    return ", ".join(available_adapters(kind)) or "(none)"


# -- the adapters that ship with remote-g2 -----------------------------------
# Later parts add their "engine" and "transfer" entries here, and only here.

register_adapter("pool", "host", "remote_g2.adapters.host_pool", "HostPool")
register_adapter("transfer", "nixl", "remote_g2.adapters.nixl_transfer", "NixlTransfer")
register_adapter("transfer", "memcpy", "remote_g2.adapters.memcpy_transfer", "MemcpyTransfer")
register_adapter("engine", "reference", "remote_g2.adapters.reference.executor", "Executor")
register_adapter("engine", "vllm", "remote_g2.adapters.vllm", "RemoteG2Connector")
register_adapter("engine", "trtllm", "remote_g2.adapters.trtllm.hooks", "start_remote_g2")
register_adapter("pool", "trtllm", "remote_g2.adapters.trtllm.pool", "TrtllmSecondaryPool")
