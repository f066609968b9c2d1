"""The block registry: block hash → the workers that hold it in G2.

Packages (each ``__init__`` says what it may import)::

    server/    the registry server, its change feed, metrics, ``remote-g2 serve``
    stores/    the storage contract; memory, Redis, Redis Cluster; the Lua scripts
    client/    the typed client, the publisher, the in-process mirror, ``remote-g2 admin``
    scoring/   the router-facing scoring API and vLLM KV-event ingest
    metrics.py the server's Prometheus metrics (the server and the KV-event ingest count into them)

Dependencies point one way: ``server -> client, scoring -> stores`` (tests/test_layout.py).

Public names (imported lazily so a client does not pull in redis or prometheus)::

    RegistryClient    typed client, one method per message      (client/registry_client.py)
    SourcePublisher   keeps a worker's blocks current            (client/publisher.py)
    RegistryMirror    an in-process copy that answers lookups    (client/mirror.py)
    RegistryServer    the server in front of a store             (server/service.py)
    open_store        memory / Redis / Redis Cluster by URL      (stores/factory.py)
    RegistryStore     the storage contract                       (stores/contract.py)
"""

from __future__ import annotations

from remote_g2.lazy_exports import lazy_getattr

_EXPORTS = {
    "RegistryClient": ".client.registry_client",
    "SourcePublisher": ".client.publisher",
    "RegistryServer": ".server.service",
    "RegistryMirror": ".client.mirror",
    "open_store": ".stores.factory",
    "RegistryStore": ".stores.contract",
    "MemoryStore": ".stores.memory",
}

__all__ = sorted(_EXPORTS)

__getattr__ = lazy_getattr(__name__, _EXPORTS)
