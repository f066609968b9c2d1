"""The registry store on Redis (:class:`RedisStore`) and Redis Cluster (:class:`RedisClusterStore`).

Both hold the contract of :mod:`.store`; every server in front of one Redis
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

Parts: the scripts and how they are sent are in :mod:`.redis_scripts`; key
names and the node sets (one node, Sentinel, Cluster) in :mod:`.redis_nodes`;
this module holds the store's commands, grouped by concern.

Errors: any Redis or connection failure becomes
:class:`~remote_g2.errors.StoreUnavailable`; connections are re-made by
redis-py on the next call, and on Cluster a failed call refreshes the slot
table once and retries before giving up.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import re
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, TypeVar, cast

import redis
from redis.exceptions import ClusterError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from remote_g2.errors import RegistryError, StaleEpoch, StoreUnavailable
from remote_g2.protocol.messages import (
    BlockEvent, DrainWorkerReply, Events, EventsReply, Heartbeat, HeartbeatReply, Holder, LayoutFingerprint, Lookup,
    LookupReply, RegisterWorker, RegisterWorkerReply, Resync, ResyncReply, WorkerRecord,
)

from .redis_nodes import REDIS_ERRORS, ClusterNodes, Keys, SentinelNode, SingleNode
from .redis_scripts import Scripts
from .contract import DEFAULT_LEASE_TTL_MS, ConvertedLookups, PendingLookups, RegistryStore

__all__ = ["RedisStore", "RedisClusterStore", "RedisSentinelStore", "DEFAULT_KEY_PREFIX"]

log = logging.getLogger("remote_g2.registry")

DEFAULT_KEY_PREFIX = "rg2:"
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException)

P = ParamSpec("P")
R = TypeVar("R")


def _command(retry: bool = True) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Turn Redis failures into StoreUnavailable; with ``retry``, a whole call is rerun once on Cluster."""
    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            store: _RedisBase = args[0]  # type: ignore[assignment]
            try:
                if retry:
                    return store._nodes.retrying(lambda: method(*args, **kwargs))
                return method(*args, **kwargs)
            except REDIS_ERRORS as e:
                raise _unavailable(store, e) from e
        return call
    return wrap


def _unavailable(store: _RedisBase, e: Exception) -> StoreUnavailable:
    what = "unreachable" if isinstance(e, _UNREACHABLE) else "failed"
    return StoreUnavailable(f"redis at {store._nodes.address} {what}: {type(e).__name__}: {e}")


# -- the store, by concern ------------------------------------------------------------------------


class _RedisBase(RegistryStore):
    """Connection, keys, scripts and the few helpers every group of commands uses."""

    default_sweep_grace_ms = 0

    def __init__(self, nodes: SingleNode | ClusterNodes, lease_ttl_ms: int, key_prefix: str | bytes,
                 sweep_grace_ms: int | None, sweep_max_incarnations: int, sweep_max_keys: int) -> None:
        super().__init__(lease_ttl_ms)
        prefix = key_prefix.encode() if isinstance(key_prefix, str) else bytes(key_prefix)
        if b"{" in prefix or b"}" in prefix:
            raise ValueError("key_prefix must not contain '{' or '}' (it would pin every key to one Cluster slot)")
        self._nodes = nodes
        self._keys = Keys(prefix)
        self._scripts = Scripts()
        self.sweep_grace_ms = self.default_sweep_grace_ms if sweep_grace_ms is None else sweep_grace_ms
        self.sweep_max_incarnations = sweep_max_incarnations
        self.sweep_max_keys = sweep_max_keys
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self._audit_cursors: dict[tuple[str, bytes], int] = {}  # (node, key pattern) -> SCAN cursor

    def _meta(self, script: str, *args: Any) -> Any:
        """Run a script on the meta slot's node."""
        _, client = self._nodes.node(self._keys.lease)
        return self._scripts.run(client, script, self._keys.lease, [*self._keys.header, *args])

    def _fan_out(self, calls: Sequence[Callable[[], R]]) -> list[R]:
        """Run the calls (one per node) in parallel; the first on this thread."""
        if len(calls) <= 1:
            return [c() for c in calls]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rg2-redis")
        futures = [self._pool.submit(c) for c in calls[1:]]
        first = calls[0]()
        return [first, *(f.result() for f in futures)]

    def _per_node(self, script: str, hashes: Sequence[bytes]) -> list[tuple[list[int], Any]]:
        """Run a per-node script (ARGV: hashes) once on every node holding some of the hashes' block sets.

        Returns (indexes into ``hashes`` that node got, its reply) per node.
        """
        keys = [self._keys.block + h for h in hashes]
        groups = list(self._nodes.group(keys).values())
        replies = self._fan_out([functools.partial(self._scripts.run, c, script, keys[idx[0]],
                                                   [*self._keys.header, *(hashes[i] for i in idx)])
                                 for c, idx in groups])
        return [(idx, r) for (_, idx), r in zip(groups, replies)]

    def _block_ops(self, inc: bytes, adds: Sequence[bytes], removes: Sequence[bytes]) -> None:
        """Add ``inc`` to the block sets of ``adds`` and take it out of those of ``removes``, node by node."""
        ops = [*adds, *removes]
        if not ops:
            return
        keys = [self._keys.block + h for h in ops]
        n_add = len(adds)

        def call(client: redis.Redis, idx: list[int]) -> Any:
            mine_add = [ops[i] for i in idx if i < n_add]
            mine_rem = [ops[i] for i in idx if i >= n_add]
            return self._scripts.run(client, "block_ops", keys[idx[0]],
                                     [*self._keys.header, inc, len(mine_add), *mine_add, *mine_rem])
        self._fan_out([functools.partial(call, c, idx) for c, idx in self._nodes.group(keys).values()])

    def _block_counts(self, incs: Sequence[bytes]) -> list[int]:
        """SCARD of each incarnation's ``wb`` set, one pipeline per node."""
        keys = [self._keys.wb(inc) for inc in incs]
        out = [0] * len(keys)
        for client, idx in self._nodes.group(keys).values():
            pipe = client.pipeline(transaction=False)
            for i in idx:
                pipe.scard(keys[i])
            for i, n in zip(idx, pipe.execute()):
                out[i] = n
        return out

    def _wb_write(self, inc: bytes, adds: Sequence[bytes], removes: Sequence[bytes],
                  count: bool) -> int:
        """Node-batched block writes for one incarnation; returns its block count when ``count``.

        ``wb`` grows before and shrinks after the block sets, so after any
        failure ``wb`` still names every block set that holds ``inc`` and the
        sweeper can find them. Idempotent (set adds/removes of a net effect).
        """
        wb = self._keys.wb(inc)
        _, client = self._nodes.node(wb)
        for chunk in _chunks(adds):
            client.sadd(wb, *chunk)
        self._block_ops(inc, adds, removes)
        pipe = client.pipeline(transaction=False)
        for chunk in _chunks(removes):
            pipe.srem(wb, *chunk)
        if count:
            pipe.scard(wb)
        replies = pipe.execute() if len(pipe) else []
        return int(replies[-1]) if count else 0

    @_command()
    def ping(self) -> None:
        self._nodes.node(self._keys.lease)[1].ping()

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
        self._scripts.close()
        self._nodes.close()


class _WorkerCommands(_RedisBase):
    """Registration, liveness, records: each one script on the meta slot."""

    @_command()
    def register_worker(self, req: RegisterWorker) -> RegisterWorkerReply:
        fp = req.fingerprint
        status, value = self._meta("register", req.worker_id, req.epoch, req.endpoint, _fp_json(fp),
                                   fp.compat_key(), fp.tp_size, self.lease_ttl_ms, _nonce())
        if status == b"new":
            return RegisterWorkerReply(self.lease_ttl_ms, 1, True)
        if status == b"renewed":
            return RegisterWorkerReply(self.lease_ttl_ms, int(value) + 1, False)
        if status == b"stale":
            raise StaleEpoch(f"worker {req.worker_id!r} registered with epoch {req.epoch}, "
                             f"older than the live epoch {value.decode()}")
        raise StaleEpoch(f"worker {req.worker_id!r} re-registered epoch {req.epoch} with a "
                         "different endpoint or fingerprint; use a new epoch")

    @_command()
    def heartbeat(self, req: Heartbeat) -> HeartbeatReply:
        renewed = self._meta("heartbeat", req.worker_id, req.epoch, req.load, self.lease_ttl_ms)
        if renewed == 2:  # the topology changed since its blocks were stored: some may be lost
            return HeartbeatReply("resync_needed", self.lease_ttl_ms)
        if renewed:
            return HeartbeatReply("ok", self.lease_ttl_ms)
        return HeartbeatReply("unknown_worker", 0)

    def _records(self, worker_ids: Sequence[str]) -> list[WorkerRecord]:
        return [record for _, record in self._records_with_incs(worker_ids)]

    def _records_with_incs(self, worker_ids: Sequence[str]) -> list[tuple[bytes, WorkerRecord]]:
        rows = self._meta("workers", *worker_ids)
        blocks = self._block_counts([row[1] for row in rows])
        out = []
        for (wid, inc, left, endpoint, epoch, fp, seq, load, reg), n in zip(rows, blocks):
            fingerprint = LayoutFingerprint(**json.loads(fp))
            out.append((inc, WorkerRecord(
                worker_id=wid.decode(), endpoint=endpoint.decode(), epoch=int(epoch), tp_size=fingerprint.tp_size,
                fingerprint=fingerprint, live=left > 0, lease_expires_in_ms=int(left), blocks=n,
                last_seq=int(seq), load=int(load), registered_at_ms=int(reg))))
        return out

    @_command()
    def scan_worker(self, worker_id: str, cursor: bytes, count: int) -> tuple[WorkerRecord | None, list[bytes], bytes]:
        # SSCAN's own guarantee is the contract: members present for the whole
        # scan come back at least once. The cursor is SSCAN's, as decimal text.
        rows = self._records_with_incs([worker_id])
        if not rows or not rows[0][1].live:
            return None, [], b""
        inc, record = rows[0]
        if cursor and not cursor.isdigit():
            raise RegistryError(f"scan_worker: cursor {cursor!r:.40} is not one this store handed out")
        key = self._keys.wb(inc)
        _, client = self._nodes.node(key)
        nxt, members = client.sscan(key, cursor=int(cursor or b"0"), count=count)
        return record, list(members), (b"" if int(nxt) == 0 else str(int(nxt)).encode())

    @_command()
    def worker_info(self, worker_id: str) -> WorkerRecord | None:
        records = self._records([worker_id])
        return records[0] if records else None

    @_command()
    def list_workers(self, *, include_dead: bool = False) -> list[WorkerRecord]:
        return sorted((r for r in self._records([]) if include_dead or r.live), key=lambda r: r.worker_id)

    @_command()
    def drain_worker(self, worker_id: str) -> DrainWorkerReply:
        inc = self._meta("drain", worker_id)
        if not inc:
            return DrainWorkerReply(False, 0)
        return DrainWorkerReply(True, self._block_counts([inc])[0])

    @_command()
    def counts(self) -> tuple[int, int, int]:
        live, total, incs = self._meta("counts")
        return int(live), int(total), sum(self._block_counts(incs))


class _LookupCommands(_RedisBase):
    """The target side: prefix lookup and who-has."""

    @_command()
    def lookup(self, hashes: Sequence[bytes], *, compat_key: str | None = None, requester: str | None = None,
               want_all_holders: bool = False, tie_breaker: int = 0) -> LookupReply:
        if not hashes:
            return LookupReply("no_candidate", 0)
        payload: list[bytes] = list(hashes)
        kinds = bytearray(b"k" * len(payload))
        meta_name, meta_client = self._nodes.node(self._keys.lease)
        keys: list[bytes] = []
        remote: list[tuple[redis.Redis, list[int]]] = []
        if not self._nodes.all_keys_local:  # Cluster: read other nodes' block sets first, one call per node
            keys = [self._keys.block + h for h in payload]
            remote = [(c, idx) for name, (c, idx) in self._nodes.group(keys).items() if name != meta_name]
        if remote:
            replies = self._fan_out([functools.partial(self._scripts.run, c, "members", keys[idx[0]],
                                                       [*self._keys.header, *(payload[i] for i in idx)])
                                     for c, idx in remote])
            for (_, idx), members in zip(remote, replies):
                for i, m in zip(idx, members):
                    kinds[i] = ord("m")
                    payload[i] = b",".join(m)
            if kinds[0] == ord("m") and not payload[0]:
                return LookupReply("no_candidate", 0)  # nobody, live or dead, holds the first block
        reply = self._scripts.run(meta_client, "lookup", self._keys.lease,
                                  self._lookup_args(payload, bytes(kinds), requester, compat_key, want_all_holders))
        return _lookup_reply(reply, tie_breaker)

    @_command()
    def lookup_many(self, requests: Sequence[Lookup], tie_breakers: Sequence[int]) -> list[LookupReply]:
        started = self.start_lookups(requests, tie_breakers)
        return started if isinstance(started, list) else started.result()

    def start_lookups(self, requests: Sequence[Lookup],
                      tie_breakers: Sequence[int]) -> PendingLookups | list[LookupReply]:
        if not self._nodes.all_keys_local:
            return super().lookup_many(requests, tie_breakers)
        # One node: every lookup is one EVALSHA, so the batch is one pipelined write; the
        # replies are read when the caller's poller sees them arrive.
        _, client = self._nodes.node(self._keys.lease)
        try:
            pending = self._scripts.start_many(client, "lookup", self._keys.lease, [
                self._lookup_args(r.hashes, b"k" * len(r.hashes), r.requester, r.compat_key, r.want_all_holders)
                for r in requests])
        except REDIS_ERRORS as e:
            raise _unavailable(self, e) from e
        ties = list(tie_breakers)
        return ConvertedLookups(pending, lambda replies: [_lookup_reply(raw, t) for raw, t in
                                                          zip(replies, ties, strict=True)],
                                errors=REDIS_ERRORS, on_error=lambda e: _unavailable(self, e))

    def _lookup_args(self, payload: Sequence[bytes], kinds: bytes, requester: str | None,
                     compat_key: str | None, want_all_holders: bool) -> list[Any]:
        return [*self._keys.header, requester or "", compat_key or "", b"1" if want_all_holders else b"0",
                b"inc" if self._nodes.all_keys_local else b"pos", kinds, *payload]

    def raw_lookup(self, client: redis.Redis, hashes: Sequence[bytes]) -> Any:
        """One EVALSHA of the lookup script on ``client``, reply left raw (single node only).

        The benchmark's baseline: the same Redis work as :meth:`lookup`, without
        this class's Python around it. Returns ``[b"ok", matched, tied, holders]``
        or ``[reason]``.
        """
        return self._scripts.run(client, "lookup", self._keys.lease,
                                 self._lookup_args(hashes, b"k" * len(hashes), None, None, False))

    @_command()
    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> list[list[str]]:
        hashes = list(hashes)
        members: list[list[bytes]] = [[] for _ in hashes]
        for idx, reply in self._per_node("members", hashes):
            for i, m in zip(idx, reply):
                members[i] = m
        incs = sorted({inc for m in members for inc in m})
        if not incs:
            return [[] for _ in hashes]
        owner = {}
        for inc, row in zip(incs, self._meta("who_is", *incs)):
            if row and (include_dead or row[1]):
                owner[inc] = row[0].decode()
        return [sorted({owner[inc] for inc in m if inc in owner}) for m in members]


class _SweepCommands(_RedisBase):
    """Background clean-up of retired incarnations: bounded, idempotent, safe to run concurrently."""

    #: Block sets touched per round trip while sweeping.
    sweep_chunk = 1000

    @_command()
    def sweep(self) -> int:
        ready = self._meta("reap", self.sweep_max_incarnations, self.sweep_grace_ms)
        removed, budget = 0, self.sweep_max_keys
        _, meta_client = self._nodes.node(self._keys.lease)
        for inc in ready:
            wb = self._keys.wb(inc)
            _, client = self._nodes.node(wb)
            while budget > 0:
                chunk = cast(list[bytes], client.srandmember(wb, min(self.sweep_chunk, budget)))
                if not chunk:
                    removed += meta_client.zrem(self._keys.gone, inc)  # 0 if a concurrent sweeper won
                    break
                self._block_ops(inc, (), chunk)  # block sets first, so wb keeps naming what is left
                client.srem(wb, *chunk)
                budget -= len(chunk)
            if budget <= 0:
                break
        self.audit()
        self.record_topology()
        return removed

    def prepare(self) -> None:
        # Recorded before the first registration, so workers that register now are marked with it and
        # the first sweep does not find them all "filled under another topology" (a needless resync each).
        try:
            self.record_topology()
        except (StoreUnavailable, redis.RedisError, OSError) as e:
            log.warning("registry store: could not record the Redis topology yet (%s); the sweeper will", e)

    def record_topology(self) -> bytes:
        """Record which Redis processes hold the data now (each master's run id) in ``P{m}:topo``; the value.

        A changed value — a master failed over to its replica, or restarted —
        may mean lost writes the store cannot see (a block set's last
        ``SADD``). Every worker whose blocks were stored under another value
        is then answered ``resync_needed`` (heartbeat, event batch) until it
        resyncs, so every worker's view converges. Every server's sweeper
        records it once a second; servers that see the same masters write the same value.
        """
        run_ids = []
        for name, client in sorted(self._nodes.clients().items()):
            run_ids.append(f"{name}={client.info('server')['run_id']}")
        topology = hashlib.sha1("\n".join(run_ids).encode()).hexdigest()[:16].encode()
        _, meta = self._nodes.node(self._keys.topo)
        before = meta.get(self._keys.topo)
        if before != topology:
            meta.set(self._keys.topo, topology)
            # No record before: a fresh store (every start on an empty Redis), or a meta node that lost it.
            log.log(logging.INFO if before is None else logging.WARNING,
                    "registry store: Redis topology %s %s (%s); any worker stored under another record resyncs",
                    "recorded:" if before is None else "is now", topology.decode(), ", ".join(run_ids))
        return topology

    def audit(self) -> tuple[int, int]:
        """One bounded step of the orphan audit (the module docstring, "Lost writes"): on every node, the next
        ``sweep_chunk`` keys of each kind. Returns (``wb`` sets queued for the sweeper, block-set members removed).

        Idempotent and safe beside other sweepers: it only touches ids the meta slot does not know, and ids
        never repeat.
        """
        queued = removed = 0
        wb_prefix = self._keys.header[2] + b"{"
        for name, client in self._nodes.clients().items():
            keys = self._audit_scan(name, client, _glob_escape(wb_prefix) + b"*")
            incs = [k[len(wb_prefix):-1] for k in keys if k.endswith(b"}")]
            if incs:
                queued += len(self._meta("orphans", b"1", *incs))
            keys = self._audit_scan(name, client, _glob_escape(self._keys.block) + b"*")
            if not keys:
                continue
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.smembers(key)
            members = [cast(set[bytes], m) for m in pipe.execute()]
            incs = sorted(set().union(*members))
            orphans = set(self._meta("orphans", b"0", *incs)) if incs else set()
            if orphans:
                pipe = client.pipeline(transaction=False)
                for key, held in zip(keys, members):
                    if gone := held & orphans:
                        pipe.srem(key, *gone)
                removed += sum(pipe.execute())
        return queued, removed

    def _audit_scan(self, node: str, client: redis.Redis, pattern: bytes) -> list[bytes]:
        """The next keys matching ``pattern`` on ``node`` (about ``sweep_chunk``), resuming the last scan."""
        cursor = self._audit_cursors.get((node, pattern), 0)
        cursor, keys = client.scan(cursor, match=pattern, count=self.sweep_chunk)
        self._audit_cursors[(node, pattern)] = int(cursor)
        return cast(list[bytes], keys)


class RedisStore(_WorkerCommands, _LookupCommands, _SweepCommands):
    """Single-node Redis: each worker-side call and each lookup is one atomic EVALSHA.

    ``url`` is a redis-py URL (``redis://host:port/db``, ``rediss://``,
    ``unix://``). Thread-safe; the connection pool holds up to
    ``max_connections`` sockets (callers beyond that wait up to the timeout).
    """

    name = "redis"

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, *,
                 key_prefix: str | bytes = DEFAULT_KEY_PREFIX, socket_timeout_s: float = 2.0,
                 max_connections: int = 64, sweep_grace_ms: int | None = None,
                 sweep_max_incarnations: int = 64, sweep_max_keys: int = 20_000) -> None:
        super().__init__(self._connect(url, socket_timeout_s, max_connections), lease_ttl_ms, key_prefix,
                         sweep_grace_ms, sweep_max_incarnations, sweep_max_keys)

    @staticmethod
    def _connect(url: str, socket_timeout_s: float, max_connections: int) -> SingleNode | ClusterNodes:
        return SingleNode(url, socket_timeout_s, max_connections)

    @_command()
    def apply_events(self, req: Events) -> EventsReply:
        kinds = bytearray()
        counts: list[int] = []
        hashes: list[bytes] = []
        for ev in req.events:
            kinds += _KIND[ev.kind]
            if ev.kind == "cleared":
                counts.append(0)
            else:
                counts.append(len(ev.hashes))
                hashes += ev.hashes
        status, value = self._meta("events", req.worker_id, req.epoch, req.seq, req.seq - 1, bytes(kinds),
                                   *counts, *hashes, _nonce())
        return _events_reply(status, value, req.seq)

    @_command()
    def resync(self, req: Resync) -> ResyncReply:
        status, last_seq, stored = self._meta("resync", req.worker_id, req.epoch, b"1" if req.first else b"0",
                                              req.seq - 1 if req.last else b"", *req.hashes, _nonce())
        if status != b"ok":
            return ResyncReply("unknown_worker", 0, 0)
        return ResyncReply("ok", int(last_seq) + 1, int(stored))


class RedisSentinelStore(RedisStore):
    """Single-node Redis under Redis Sentinel: ``url`` is ``host:port[,host:port...]/service`` (the sentinels
    and the name they monitor the master under). The same store as :class:`RedisStore`, on whichever server
    the sentinels name master now; after a failover the next connection goes to the new master, and the
    sweepers' topology record makes every worker resync what the promotion lost (module docstring)."""

    name = "redis-sentinel"

    @staticmethod
    def _connect(url: str, socket_timeout_s: float, max_connections: int) -> SingleNode | ClusterNodes:
        return SentinelNode(url, socket_timeout_s, max_connections)


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

    @staticmethod
    def _connect(url: str, socket_timeout_s: float, max_connections: int) -> SingleNode | ClusterNodes:
        return ClusterNodes(url, socket_timeout_s, max_connections)

    @_command(retry=False)  # the meta step is not idempotent; each step retries by itself
    def apply_events(self, req: Events) -> EventsReply:
        segments: list[list[BlockEvent]] = [[]]  # the events between `cleared`s
        for ev in req.events:
            if ev.kind == "cleared":
                segments.append([])
            else:
                segments[-1].append(ev)
        nonce = _nonce()
        reply = self._nodes.retrying(lambda: self._meta("begin_batch", req.worker_id, req.epoch, b"e", req.seq,
                                                        req.seq - 1, len(segments) - 1, nonce))
        if reply[0] != b"ok":
            return _events_reply(reply[0], reply[1], req.seq)
        applied = 0
        for n, (events, inc) in enumerate(zip(segments, reply[2:])):
            adds, removes, touched = _net_effect(events)
            cleared_after = n < len(segments) - 1
            applied += touched + self._nodes.retrying(
                lambda: self._wb_write(inc, adds, removes, count=cleared_after))
        return EventsReply("ok", req.seq + 1, applied)

    @_command(retry=False)
    def resync(self, req: Resync) -> ResyncReply:
        nonce = _nonce()
        reply = self._nodes.retrying(lambda: self._meta("begin_batch", req.worker_id, req.epoch, b"r",
                                                        b"1" if req.first else b"0",
                                                        req.seq - 1 if req.last else b"", nonce))
        if reply[0] != b"ok":
            return ResyncReply("unknown_worker", 0, 0)
        _, last_seq, inc = reply
        adds = list(dict.fromkeys(req.hashes))
        stored = self._nodes.retrying(lambda: self._wb_write(inc, adds, (), count=True))
        return ResyncReply("ok", int(last_seq) + 1, stored)


# -- small pure helpers -------------------------------------------------------------------------

_KIND = {"stored": b"s", "removed": b"r", "cleared": b"c"}


def _glob_escape(text: bytes) -> bytes:
    """``text`` as a literal in a ``SCAN MATCH`` pattern."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", text)


def _nonce() -> bytes:
    """What a script that may make an incarnation appends to its ARGV (``fresh_inc`` in ``registry/stores/lua/_lib.lua``):
    9 random decimal digits, drawn per call, so an id stays new even when Redis hands a counter value out again."""
    return b"%09d" % secrets.randbelow(10**9)


def _fp_json(fp: LayoutFingerprint) -> str:
    """Canonical text of a fingerprint: equal fingerprints give equal strings (compared inside Lua)."""
    return json.dumps(dataclasses.asdict(fp), sort_keys=True, separators=(",", ":"))


def _lookup_reply(reply: Any, tie_breaker: int) -> LookupReply:
    """A lookup script's reply as a :class:`LookupReply` (see ``lua/lookup.lua``)."""
    if reply[0] != b"ok":
        return LookupReply(reply[0].decode(), 0)
    _, matched, tied, holders = reply
    tied = sorted((Holder(w.decode(), e.decode(), int(tp), matched) for w, e, tp in tied),
                  key=lambda x: x.worker_id)
    everyone = sorted((Holder(w.decode(), e.decode(), int(tp), m) for w, e, tp, m in holders),
                      key=lambda x: (-x.matched, x.worker_id))
    return LookupReply("ok", matched, tied[tie_breaker % len(tied)], everyone)


def _events_reply(status: bytes, value: bytes, seq: int) -> EventsReply:
    """Reply from a script's {status, value}: value is `applied` when ok, the last applied seq when not."""
    if status == b"ok":
        return EventsReply("ok", seq + 1, int(value))
    if status == b"resync_needed":
        return EventsReply("resync_needed", int(value) + 1, 0)
    return EventsReply("unknown_worker", 0, 0)


def _net_effect(events: Iterable[BlockEvent]) -> tuple[list[bytes], list[bytes], int]:
    """(hashes present after the events, hashes absent after them, hashes touched), in first-seen order.

    Applying the net effect is idempotent, which is what makes a retried node call safe.
    """
    state: dict[bytes, bool] = {}
    touched = 0
    for ev in events:
        present = ev.kind == "stored"
        for h in ev.hashes:
            state[h] = present
        touched += len(ev.hashes)
    return [h for h, p in state.items() if p], [h for h, p in state.items() if not p], touched


def _chunks(items: Sequence[bytes], size: int = 4096) -> Iterable[Sequence[bytes]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
