"""Pick the registry's store from its settings: memory, Redis or Redis Cluster.

The Redis backends are imported only when asked for, so the embedded default
needs no redis package at import time.
"""

from __future__ import annotations

from typing import Any

from remote_g2.errors import ConfigError

from .store import DEFAULT_LEASE_TTL_MS, RegistryStore

__all__ = ["open_store"]


def open_store(redis_url: str | None = None, redis_cluster_url: str | None = None,
               lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, **options: Any) -> RegistryStore:
    """A store for these settings; nothing connects until the first call.

    * ``redis_cluster_url`` (any node of the cluster) → :class:`~.store_redis.RedisClusterStore`;
    * ``redis_url`` → :class:`~.store_redis.RedisStore` (single node);
    * neither → :class:`~.store_memory.MemoryStore` (embedded, one process).

    ``options`` go to the Redis store (``key_prefix``, ``socket_timeout_s``,
    ``max_connections``, ``sweep_grace_ms``, ...); they are an error for memory.
    Raises :class:`~remote_g2.errors.ConfigError` for conflicting settings.
    """
    if redis_url and redis_cluster_url:
        raise ConfigError("give redis_url or redis_cluster_url, not both")
    if redis_cluster_url:
        from .store_redis import RedisClusterStore

        return RedisClusterStore(redis_cluster_url, lease_ttl_ms, **options)
    if redis_url:
        from .store_redis import RedisStore

        return RedisStore(redis_url, lease_ttl_ms, **options)
    if options:
        raise ConfigError(f"options {sorted(options)} apply to a Redis store only")
    from .store_memory import MemoryStore

    return MemoryStore(lease_ttl_ms)
