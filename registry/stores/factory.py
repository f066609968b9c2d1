"""Pick the registry's store from its settings: memory, Redis, Redis under Sentinel, or Redis Cluster.

The Redis backends are imported only when asked for, so the embedded default
needs no redis package at import time.
"""

from __future__ import annotations

from typing import Any

from remote_g2.errors import ConfigError

from .contract import DEFAULT_LEASE_TTL_MS, RegistryStore

__all__ = ["open_store"]


def open_store(redis_url: str | None = None, redis_cluster_url: str | None = None,
               lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, *, redis_sentinel: str | None = None,
               **options: Any) -> RegistryStore:
    """A store for these settings; nothing connects until the first call.

    * ``redis_cluster_url`` (any node of the cluster) → :class:`~.redis_store.RedisClusterStore`;
    * ``redis_url`` → :class:`~.redis_store.RedisStore` (single node);
    * ``redis_sentinel`` (``host:port[,...]/service``) → :class:`~.redis_store.RedisSentinelStore`
      (single node, its master named by Redis Sentinel);
    * neither → :class:`~.memory.MemoryStore` (embedded, one process).

    ``options`` go to the Redis store (``key_prefix``, ``socket_timeout_s``,
    ``max_connections``, ``sweep_grace_ms``, ...); they are an error for memory.
    Raises :class:`~remote_g2.errors.ConfigError` for conflicting settings.
    """
    if sum(bool(x) for x in (redis_url, redis_cluster_url, redis_sentinel)) > 1:
        raise ConfigError("give one of redis_url, redis_cluster_url and redis_sentinel")
    if redis_sentinel:
        from .redis_store import RedisSentinelStore

        return RedisSentinelStore(redis_sentinel, lease_ttl_ms, **options)
    if redis_cluster_url:
        from .redis_store import RedisClusterStore

        return RedisClusterStore(redis_cluster_url, lease_ttl_ms, **options)
    if redis_url:
        from .redis_store import RedisStore

        return RedisStore(redis_url, lease_ttl_ms, **options)
    if options:
        raise ConfigError(f"options {sorted(options)} apply to a Redis store only")
    from .memory import MemoryStore

    return MemoryStore(lease_ttl_ms)
