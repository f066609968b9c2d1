"""Where a registry key lives: key names, and the Redis nodes behind them (one node, Sentinel, Cluster).

:class:`Keys` names every key of one ``key_prefix`` (the layout is in
:mod:`.redis_store`'s docstring). A node set answers which client holds a
key, groups keys by node for one call per node, and on Cluster refreshes its
slot table and reruns a call once when a node moved or died. Used by
the Redis store's modules only (:mod:`.redis_keyspace` holds one).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.exceptions import RedisClusterException, RedisError
from redis.retry import Retry

from remote_g2.errors import ConfigError

R = TypeVar("R")
#: every failure a Redis call can raise (the store turns them into StoreUnavailable)
REDIS_ERRORS = (RedisError, RedisClusterException)


class Keys:
    """Key names (bytes, binary-safe) for one ``key_prefix``; the layout is in :mod:`.redis_store`'s docstring."""

    __slots__ = ("prefix", "meta", "lease", "gone", "topo", "block", "header")

    def __init__(self, prefix: bytes) -> None:
        self.prefix = prefix
        self.meta = prefix + b"{m}:"
        self.lease = self.meta + b"lease"
        self.gone = self.meta + b"gone"
        self.topo = self.meta + b"topo"
        self.block = prefix + b"b:"
        #: ARGV[1..3] of every script (see ``lua/_lib.lua``).
        self.header = (self.meta, self.block, prefix + b"wb:")

    def wb(self, inc: bytes) -> bytes:
        return self.prefix + b"wb:{" + inc + b"}"


# -- connections ------------------------------------------------------------------------------

NodeGroups = dict[str, tuple[redis.Redis, list[int]]]


def _connection_options(socket_timeout_s: float) -> dict[str, Any]:
    # One immediate retry replaces a pooled socket that died with a restarted
    # server; no backoff, so an unreachable Redis fails within the timeouts.
    return {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s,
            "retry": Retry(NoBackoff(), 1), "health_check_interval": 30}


def _address(url: str) -> str:
    parts = urlsplit(url)
    return parts.path if parts.scheme == "unix" else f"{parts.hostname or '127.0.0.1'}:{parts.port or 6379}"


class SingleNode:
    """One Redis: every key is on the one node; redis-py reconnects by itself."""

    all_keys_local = True

    def __init__(self, url: str, socket_timeout_s: float, max_connections: int) -> None:
        self.address = _address(url)
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections,
                                                     timeout=socket_timeout_s,
                                                     **_connection_options(socket_timeout_s))
        self.client = redis.Redis(connection_pool=pool)

    def node(self, key: bytes) -> tuple[str, redis.Redis]:
        return "", self.client

    def group(self, keys: Sequence[bytes]) -> NodeGroups:
        return {"": (self.client, list(range(len(keys))))} if keys else {}

    def clients(self) -> dict[str, redis.Redis]:
        """Every node, by name."""
        return {"": self.client}

    def retrying(self, fn: Callable[[], R]) -> R:
        return fn()  # the connection's own Retry already covers a stale socket

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()


class SentinelNode(SingleNode):
    """One Redis whose master Redis Sentinel names: ``spec`` is ``host:port[,host:port...]/service``.

    Each new connection asks the sentinels for the current master; a
    connection to a master that was demoted fails (redis-py's
    ``SentinelManagedConnection``) and the next one goes to the new master.
    """

    def __init__(self, spec: str, socket_timeout_s: float, max_connections: int) -> None:
        from redis.sentinel import Sentinel

        hosts, _, service = spec.rpartition("/")
        sentinels = []
        for item in hosts.split(","):
            host, _, port = item.strip().rpartition(":")
            if not host or not port.isdigit() or not service:
                raise ConfigError(f"Redis Sentinel {spec!r}: want host:port[,host:port...]/service-name")
            sentinels.append((host, int(port)))
        self.address = f"sentinel {service} via {hosts}"
        timeouts = {"socket_timeout": socket_timeout_s, "socket_connect_timeout": socket_timeout_s}
        self._sentinel = Sentinel(sentinels, sentinel_kwargs=timeouts, **_connection_options(socket_timeout_s))
        self.client = self._sentinel.master_for(service, max_connections=max_connections)

    def close(self) -> None:
        super().close()
        for s in self._sentinel.sentinels:
            s.close()


class ClusterNodes:
    """A Redis Cluster addressed node by node, from a slot table copied out of redis-py.

    Created lazily, so a store can be built while the cluster is down and
    starts working once it is up.
    """

    all_keys_local = False

    def __init__(self, url: str, socket_timeout_s: float, max_connections: int) -> None:
        self.address = _address(url)
        self._url = url
        self._options = {**_connection_options(socket_timeout_s), "max_connections": max_connections}
        self._lock = threading.Lock()
        self._rc: RedisCluster | None = None
        # (slot -> node name, node name -> client); replaced whole, read without a lock.
        self._table: tuple[list[str], dict[str, redis.Redis]] | None = None
        self._generation = 0  # counts refreshes, so threads failing together refresh once

    def _slots(self) -> tuple[list[str], dict[str, redis.Redis]]:
        table = self._table
        if table is None:
            with self._lock:
                if self._table is None:
                    if self._rc is None:
                        self._rc = RedisCluster.from_url(self._url, **self._options)
                    self._table = self._copy_table(self._rc)
                table = self._table
        return table

    @staticmethod
    def _copy_table(rc: RedisCluster) -> tuple[list[str], dict[str, redis.Redis]]:
        names = [""] * 16384
        clients: dict[str, redis.Redis] = {}
        for slot, nodes in dict(rc.nodes_manager.slots_cache).items():
            primary = nodes[0]
            names[slot] = primary.name
            clients[primary.name] = primary.redis_connection
        if "" in names:
            raise RedisClusterException("the cluster does not cover every slot")
        return names, clients

    def refresh(self, seen_generation: int | None = None) -> None:
        """Re-read the slot table from the cluster (after MOVED, a dead node, ...).

        With ``seen_generation``, do nothing if another thread refreshed since.
        """
        with self._lock:
            if seen_generation is not None and seen_generation != self._generation:
                return
            self._generation += 1
            self._table = None
            if self._rc is not None:
                self._rc.nodes_manager.initialize()
                self._table = self._copy_table(self._rc)

    def node(self, key: bytes) -> tuple[str, redis.Redis]:
        names, clients = self._slots()
        name = names[key_slot(key)]
        return name, clients[name]

    def clients(self) -> dict[str, redis.Redis]:
        """Every master, by name."""
        return dict(self._slots()[1])

    def group(self, keys: Sequence[bytes]) -> NodeGroups:
        names, clients = self._slots()
        out: NodeGroups = {}
        for i, key in enumerate(keys):
            name = names[key_slot(key)]
            entry = out.get(name)
            if entry is None:
                out[name] = (clients[name], [i])
            else:
                entry[1].append(i)
        return out

    def retrying(self, fn: Callable[[], R]) -> R:
        """Run ``fn`` (which must be safe to repeat); on a Redis error refresh the slot table once and rerun."""
        generation = self._generation
        try:
            return fn()
        except REDIS_ERRORS:
            self.refresh(generation)
            return fn()

    def close(self) -> None:
        with self._lock:
            if self._rc is not None:
                self._rc.close()
            self._rc, self._table = None, None
