"""The block registry: block hash → the workers that hold it in G2.

Public names (imported lazily so a client does not pull in redis or prometheus)::

    RegistryClient    typed client, one method per message      (client.py)
    SourcePublisher   keeps a worker's blocks current            (publisher.py)
    RegistryServer    the server in front of a store             (server.py)
    RegistryMirror    an in-process copy that answers lookups    (mirror.py)
    open_store        memory / Redis / Redis Cluster by URL      (store_factory.py)
    RegistryStore     the storage contract                       (store.py)
"""

from __future__ import annotations

from remote_g2.lazy_exports import lazy_getattr

_EXPORTS = {
    "RegistryClient": ".client",
    "SourcePublisher": ".publisher",
    "RegistryServer": ".server",
    "RegistryMirror": ".mirror",
    "open_store": ".store_factory",
    "RegistryStore": ".store",
    "MemoryStore": ".store_memory",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
