"""The registry store on Redis (:class:`RedisStore`) and Redis Cluster (:class:`RedisClusterStore`).

Both hold the contract of :mod:`.contract`; every server in front of one Redis
gives the same answers because all state, the clock included (Redis ``TIME``),
lives in Redis. Needs Redis >= 7 (script flags).

Key layout (``P`` = ``key_prefix``, default ``rg2:``)::

    P{m}:lease      ZSET  current incarnation id -> lease expiry (ms, Redis TIME)
    P{m}:workers    HASH  worker id -> its current incarnation id
    P{m}:i:<inc>    HASH  wid, epoch, endpoint, fp, compat, tp, seq, load, reg
    P{m}:gone       ZSET  retired incarnation id -> when retired; the sweep queue
    P{m}:topo       STR   which Redis processes hold the data (a digest of the masters' run ids)
    P{m}:ctr        STR   incarnation counter; an id is its next value and a nonce the server drew
                          (registry/stores/lua/_lib.lua fresh_inc: never reused, even when Redis loses INCRs)
    Pb:<hash>       SET   incarnation ids holding the block (raw hash bytes)
    Pwb:{<inc>}     SET   hashes the incarnation holds (for "drop all" and sweep)

The ``{m}`` hash tag keeps every meta key in one Cluster slot, so each
worker-side command is one atomic script there; ``{<inc>}`` gives each
incarnation's ``wb`` set its own slot; block keys spread by their hash bytes.
Only current incarnations are in ``lease``: a superseded, cleared, drained or
reaped incarnation leaves it at once (so lookups stop seeing it) and waits in
``gone`` until :meth:`sweep` deletes its ``b:`` memberships and ``wb`` set.

Lost writes: when the meta slot forgets recent writes (a replica promoted
before it had them, a node restarted without persistence), ids still never
repeat (``fresh_inc``: the counter and a nonce), so an incarnation the meta
slot forgot is never current again and lookups ignore its memberships; each
:meth:`sweep` also audits a bounded slice of the keyspace (``SCAN`` per
node, resumed where the last call stopped): a ``wb`` set of an incarnation
the meta slot does not know is queued for the sweeper, and a block set's
member the meta slot does not know is removed, so such leftovers are
deleted within one pass over the keys (``lua/orphans.lua``).

Round trips: on one node every worker-side call and every lookup is ONE
``EVALSHA`` (``registry/stores/lua/*.lua``; loaded on first use, reloaded after
NOSCRIPT); the lookup script reads each candidate's prefix from its ``wb``
set (one SMISMEMBER over the hashes per candidate). On Cluster a lookup reads
the block sets of the other nodes with one call per node, in parallel, then
runs the same lookup script on the meta slot's node (liveness, layout filter,
and a walk hash by hash over its own block sets and the ones read); an event
batch is one call to the meta node (validate, advance ``seq``), then writes
``wb`` before and after one call per node for the block sets, so that ``wb``
always covers what the block sets hold. A node call declares one key (for
routing) and names the rest in ARGV: Redis 7 refuses declared keys of several
slots (CROSSSLOT) even with ``allow-cross-slot-keys``, but lets such a script
touch undeclared keys of any slot on its own node.

Parts, one object each, all sharing one :class:`~.redis_keyspace.RedisKeyspace` (the store's node set, key
names, scripts and fan-out pool): the worker-side commands in :mod:`.redis_workers`, lookups and who-has in
:mod:`.redis_lookups`, the sweep, orphan audit and topology record in :mod:`.redis_sweeps`. This module holds
the stores, which implement :class:`~.contract.RegistryStore` by handing each call to one of them. The scripts
and how they are sent are in :mod:`.redis_scripts`; key names and the node sets (one node, Sentinel, Cluster)
in :mod:`.redis_nodes`.

Errors: any Redis or connection failure becomes
:class:`~remote_g2.errors.StoreUnavailable`; connections are re-made by
redis-py on the next call, and on Cluster a failed call refreshes the slot
table once and retries before giving up.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis

from remote_g2.protocol.messages import (
    DrainWorkerReply, Events, EventsReply, Heartbeat, HeartbeatReply, Lookup, LookupReply, RegisterWorker,
    RegisterWorkerReply, Resync, ResyncReply, WorkerRecord,
)

from .contract import DEFAULT_LEASE_TTL_MS, PendingLookups, RegistryStore
from .redis_keyspace import RedisKeyspace, command
from .redis_lookups import LookupCommands
from .redis_nodes import ClusterNodes, SentinelNode, SingleNode
from .redis_sweeps import SweepCommands
from .redis_workers import ClusterWorkerCommands, WorkerCommands

__all__ = ["RedisStore", "RedisClusterStore", "RedisSentinelStore", "DEFAULT_KEY_PREFIX"]

DEFAULT_KEY_PREFIX = "rg2:"


class RedisStore(RegistryStore):
    """Single-node Redis: each worker-side call and each lookup is one atomic EVALSHA.

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://``,
    ``unix://``). Thread-safe; the connection pool holds up to
    ``max_connections`` sockets (callers beyond that wait up to the timeout).
    ``space`` is the store's :class:`~.redis_keyspace.RedisKeyspace` (its nodes, keys and scripts).
    """

    name = "redis"
    default_sweep_grace_ms = 0
    #: How the store reaches its Redis, and which worker-side commands suit it; the variants below differ here.
    _node_set: type[SingleNode] | type[ClusterNodes] = SingleNode
    _worker_commands: type[WorkerCommands] = WorkerCommands

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, *,
                 key_prefix: str | bytes = DEFAULT_KEY_PREFIX, socket_timeout_s: float = 2.0,
                 max_connections: int = 64, sweep_grace_ms: int | None = None,
                 sweep_max_incarnations: int = 64, sweep_max_keys: int = 20_000) -> None:
        nodes = self._node_set(url, socket_timeout_s, max_connections)
        super().__init__(lease_ttl_ms)
        prefix = key_prefix.encode() if isinstance(key_prefix, str) else bytes(key_prefix)
        self.space = RedisKeyspace(nodes, prefix)
        self._workers = self._worker_commands(self.space, lease_ttl_ms)
        self._lookups = LookupCommands(self.space)
        self._sweeps = SweepCommands(self.space, self.default_sweep_grace_ms if sweep_grace_ms is None
                                     else sweep_grace_ms, sweep_max_incarnations, sweep_max_keys)

    # -- worker side: redis_workers ------------------------------------------------------------

    def register_worker(self, req: RegisterWorker) -> RegisterWorkerReply:
        return self._workers.register_worker(req)

    def heartbeat(self, req: Heartbeat) -> HeartbeatReply:
        return self._workers.heartbeat(req)

    def apply_events(self, req: Events) -> EventsReply:
        return self._workers.apply_events(req)

    def resync(self, req: Resync) -> ResyncReply:
        return self._workers.resync(req)

    def worker_info(self, worker_id: str) -> WorkerRecord | None:
        return self._workers.worker_info(worker_id)

    def list_workers(self, *, include_dead: bool = False) -> list[WorkerRecord]:
        return self._workers.list_workers(include_dead=include_dead)

    def scan_worker(self, worker_id: str, cursor: bytes, count: int) -> tuple[WorkerRecord | None, list[bytes], bytes]:
        return self._workers.scan_worker(worker_id, cursor, count)

    def drain_worker(self, worker_id: str) -> DrainWorkerReply:
        return self._workers.drain_worker(worker_id)

    def counts(self) -> tuple[int, int, int]:
        return self._workers.counts()

    # -- target side: redis_lookups ------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, compat_key: str | None = None, requester: str | None = None,
               want_all_holders: bool = False, tie_breaker: int = 0) -> LookupReply:
        return self._lookups.lookup(hashes, compat_key=compat_key, requester=requester,
                                    want_all_holders=want_all_holders, tie_breaker=tie_breaker)

    @command()
    def lookup_many(self, requests: Sequence[Lookup], tie_breakers: Sequence[int]) -> list[LookupReply]:
        started = self.start_lookups(requests, tie_breakers)
        return started if isinstance(started, list) else started.result()

    def start_lookups(self, requests: Sequence[Lookup],
                      tie_breakers: Sequence[int]) -> PendingLookups | list[LookupReply]:
        if not self.space.nodes.all_keys_local:  # Cluster: a lookup is several calls, so one at a time
            return super().lookup_many(requests, tie_breakers)
        return self._lookups.start_many(requests, tie_breakers)

    def raw_lookup(self, client: redis.Redis, hashes: Sequence[bytes]) -> Any:
        """One EVALSHA of the lookup script on ``client``, reply left raw (single node only; the benchmark's
        baseline): see :meth:`.redis_lookups.LookupCommands.raw_lookup`."""
        return self._lookups.raw_lookup(client, hashes)

    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> list[list[str]]:
        return self._lookups.who_has(hashes, include_dead=include_dead)

    # -- upkeep: redis_sweeps ------------------------------------------------------------------

    def sweep(self) -> int:
        return self._sweeps.sweep()

    def prepare(self) -> None:
        self._sweeps.prepare()

    def record_topology(self) -> bytes:
        """Record which Redis processes hold the data now: :meth:`.redis_sweeps.SweepCommands.record_topology`."""
        return self._sweeps.record_topology()

    def audit(self) -> tuple[int, int]:
        """One bounded step of the orphan audit: :meth:`.redis_sweeps.SweepCommands.audit`."""
        return self._sweeps.audit()

    @command()
    def ping(self) -> None:
        self.space.nodes.node(self.space.keys.lease)[1].ping()

    def close(self) -> None:
        self.space.close()


class RedisSentinelStore(RedisStore):
    """Single-node Redis under Redis Sentinel: ``url`` is ``host:port[,host:port...]/service`` (the sentinels
    and the name they monitor the master under). The same store as :class:`RedisStore`, on whichever server
    the sentinels name master now; after a failover the next connection goes to the new master, and the
    sweepers' topology record makes every worker resync what the promotion lost (module docstring)."""

    name = "redis-sentinel"
    _node_set = SentinelNode


class RedisClusterStore(RedisStore):
    """Redis Cluster: the same store, with block keys spread over the nodes and calls batched per node.

    ``url`` names any node (``redis://host:port``). Worker-side calls are not
    atomic across nodes: an event batch first advances the worker's sequence
    (meta slot), then writes the block sets; if that fails the caller gets
    StoreUnavailable and its retry is answered ``resync_needed``. Because a
    batch validated just before its incarnation was retired may still be
    writing, retired incarnations are swept only ``sweep_grace_ms`` later.
    """

    name = "redis-cluster"
    default_sweep_grace_ms = 10_000
    _node_set = ClusterNodes
    _worker_commands = ClusterWorkerCommands
