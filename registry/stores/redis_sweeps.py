"""The Redis store's background clean-up: the sweep, the orphan audit and the topology record.

:meth:`SweepCommands.sweep` deletes the ``b:`` memberships and ``wb`` sets of
retired incarnations (those in ``gone`` for at least ``sweep_grace_ms``), a
bounded amount per call, then runs one bounded step of the orphan audit and
records the topology. Bounded, idempotent, and safe to run from several
servers at once. Why the audit and the topology record exist ("Lost
writes") and the key layout: :mod:`.redis_store`.
"""

from __future__ import annotations

import hashlib
import logging
import re
from typing import cast

import redis

from remote_g2.errors import StoreUnavailable

from .redis_keyspace import RedisKeyspace, command

__all__ = ["SweepCommands"]

log = logging.getLogger("remote_g2.registry")


class SweepCommands:
    """Background clean-up of retired incarnations: bounded, idempotent, safe to run concurrently.

    ``grace_ms``: how long a retired incarnation waits before it is swept;
    ``max_incarnations`` and ``max_keys`` bound one call's work.
    """

    #: Block sets touched per round trip while sweeping.
    sweep_chunk = 1000

    def __init__(self, space: RedisKeyspace, grace_ms: int, max_incarnations: int, max_keys: int) -> None:
        self.space = space
        self.grace_ms = grace_ms
        self.max_incarnations = max_incarnations
        self.max_keys = max_keys
        self._audit_cursors: dict[tuple[str, bytes], int] = {}  # (node, key pattern) -> SCAN cursor

    @command()
    def sweep(self) -> int:
        space = self.space
        ready = space.meta("reap", self.max_incarnations, self.grace_ms)
        removed, budget = 0, self.max_keys
        _, meta_client = space.nodes.node(space.keys.lease)
        for inc in ready:
            wb = space.keys.wb(inc)
            _, client = space.nodes.node(wb)
            while budget > 0:
                chunk = cast(list[bytes], client.srandmember(wb, min(self.sweep_chunk, budget)))
                if not chunk:
                    removed += meta_client.zrem(space.keys.gone, inc)  # 0 if a concurrent sweeper won
                    break
                space.block_ops(inc, (), chunk)  # block sets first, so wb keeps naming what is left
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
        space = self.space
        run_ids = []
        for name, client in sorted(space.nodes.clients().items()):
            run_ids.append(f"{name}={client.info('server')['run_id']}")
        topology = hashlib.sha1("\n".join(run_ids).encode()).hexdigest()[:16].encode()
        _, meta = space.nodes.node(space.keys.topo)
        before = meta.get(space.keys.topo)
        if before != topology:
            meta.set(space.keys.topo, topology)
            # No record before: a fresh store (every start on an empty Redis), or a meta node that lost it.
            log.log(logging.INFO if before is None else logging.WARNING,
                    "registry store: Redis topology %s %s (%s); any worker stored under another record resyncs",
                    "recorded:" if before is None else "is now", topology.decode(), ", ".join(run_ids))
        return topology

    def audit(self) -> tuple[int, int]:
        """One bounded step of the orphan audit (:mod:`.redis_store`'s docstring, "Lost writes"): on every
        node, the next ``sweep_chunk`` keys of each kind. Returns (``wb`` sets queued for the sweeper,
        block-set members removed).

        Idempotent and safe beside other sweepers: it only touches ids the meta slot does not know, and ids
        never repeat.
        """
        space = self.space
        queued = removed = 0
        wb_prefix = space.keys.header[2] + b"{"
        for name, client in space.nodes.clients().items():
            keys = self._audit_scan(name, client, _glob_escape(wb_prefix) + b"*")
            incs = [k[len(wb_prefix):-1] for k in keys if k.endswith(b"}")]
            if incs:
                queued += self._queue_orphans(client, wb_prefix, incs)
            keys = self._audit_scan(name, client, _glob_escape(space.keys.block) + b"*")
            if not keys:
                continue
            pipe = client.pipeline(transaction=False)
            for key in keys:
                pipe.smembers(key)
            members = [cast(set[bytes], m) for m in pipe.execute()]
            incs = sorted(set().union(*members))
            orphans = set(space.meta("orphans", b"0", *incs)) if incs else set()
            if orphans:
                pipe = client.pipeline(transaction=False)
                for key, held in zip(keys, members):
                    if gone := held & orphans:
                        pipe.srem(key, *gone)
                removed += sum(pipe.execute())
        return queued, removed

    def _queue_orphans(self, client: redis.Redis, wb_prefix: bytes, incs: list[bytes]) -> int:
        """Queue for the sweeper those of ``incs`` (their ``wb`` sets on ``client``'s node) the meta slot
        does not know, once their ``wb`` set is seen to exist after that answer.

        In that order on purpose: a sweeper takes an incarnation off the queue only once its ``wb`` set is
        gone, so a set that exists after the meta slot said "unknown" is a real orphan. Queued straight from
        the scan, a set another sweeper emptied meanwhile would be queued (and counted) a second time.
        """
        unknown = self.space.meta("orphans", b"0", *incs)
        if not unknown:
            return 0
        pipe = client.pipeline(transaction=False)
        for inc in unknown:
            pipe.exists(wb_prefix + inc + b"}")
        still = [inc for inc, n in zip(unknown, pipe.execute()) if n]
        return len(self.space.meta("orphans", b"1", *still)) if still else 0

    def _audit_scan(self, node: str, client: redis.Redis, pattern: bytes) -> list[bytes]:
        """The next keys matching ``pattern`` on ``node`` (about ``sweep_chunk``), resuming the last scan."""
        cursor = self._audit_cursors.get((node, pattern), 0)
        cursor, keys = client.scan(cursor, match=pattern, count=self.sweep_chunk)
        self._audit_cursors[(node, pattern)] = int(cursor)
        return cast(list[bytes], keys)


def _glob_escape(text: bytes) -> bytes:
    """``text`` as a literal in a ``SCAN MATCH`` pattern."""
    return re.sub(rb"([*?\[\]\\])", rb"\\\1", text)
