"""The block registry: block hash → the workers that hold it in G2.

Public names (imported lazily so a client does not pull in redis or prometheus)::

    RegistryClient    typed client, one method per message      (client.py)
    SourcePublisher   keeps a worker's blocks current            (publisher.py)
    RegistryServer    the server in front of a store             (server.py)
    open_store        memory / Redis / Redis Cluster by URL      (store_factory.py)
    RegistryStore     the storage contract                       (store.py)
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "RegistryClient": ".client",
    "SourcePublisher": ".publisher",
    "RegistryServer": ".server",
    "open_store": ".store_factory",
    "RegistryStore": ".store",
    "MemoryStore": ".store_memory",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module, __name__), name)
