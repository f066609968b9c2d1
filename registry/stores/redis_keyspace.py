"""What the Redis store's command objects share: one store's keys, nodes and scripts (:class:`RedisKeyspace`).

A :class:`RedisKeyspace` is built once per store and handed to each of its
command objects (:mod:`.redis_workers`, :mod:`.redis_lookups`,
:mod:`.redis_sweeps`). It holds the node set (:mod:`.redis_nodes`), the key
names of one ``key_prefix``, the scripts (:mod:`.redis_scripts`) and the
thread pool that per-node calls fan out on, and offers the few operations
several command groups build on: a script on the meta slot's node, a script
once per node, block-set writes node by node (``wb`` before and after, so
``wb`` always covers the block sets), block counts. The key layout these
follow is in :mod:`.redis_store`'s docstring.

:func:`command` is what every public command wears: Redis failures become
:class:`~remote_g2.errors.StoreUnavailable`, and on Cluster the whole call is
rerun once after a slot-table refresh (only where the call is idempotent).
Thread-safe; :meth:`RedisKeyspace.close` is idempotent.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, ParamSpec, Protocol, TypeVar

import redis
from redis.exceptions import ClusterError, RedisClusterException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from remote_g2.errors import StoreUnavailable

from .redis_nodes import REDIS_ERRORS, ClusterNodes, Keys, SingleNode
from .redis_scripts import Scripts

__all__ = ["RedisKeyspace", "command"]

_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ClusterError, RedisClusterException)

P = ParamSpec("P")
R = TypeVar("R")


class RedisKeyspace:
    """One store's connection, key names, scripts and fan-out pool, and the operations built on them."""

    def __init__(self, nodes: SingleNode | ClusterNodes, key_prefix: bytes) -> None:
        if b"{" in key_prefix or b"}" in key_prefix:
            raise ValueError("key_prefix must not contain '{' or '}' (it would pin every key to one Cluster slot)")
        self.nodes = nodes
        self.keys = Keys(key_prefix)
        self.scripts = Scripts()
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def unavailable(self, e: Exception) -> StoreUnavailable:
        """The error a caller sees for the Redis failure ``e``."""
        what = "unreachable" if isinstance(e, _UNREACHABLE) else "failed"
        return StoreUnavailable(f"redis at {self.nodes.address} {what}: {type(e).__name__}: {e}")

    def meta(self, script: str, *args: Any) -> Any:
        """Run a script on the meta slot's node."""
        _, client = self.nodes.node(self.keys.lease)
        return self.scripts.run(client, script, self.keys.lease, [*self.keys.header, *args])

    def fan_out(self, calls: Sequence[Callable[[], R]]) -> list[R]:
        """Run the calls (one per node) in parallel; the first on this thread."""
        if len(calls) <= 1:
            return [c() for c in calls]
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="rg2-redis")
        futures = [self._pool.submit(c) for c in calls[1:]]
        first = calls[0]()
        return [first, *(f.result() for f in futures)]

    def per_node(self, script: str, hashes: Sequence[bytes]) -> list[tuple[list[int], Any]]:
        """Run a per-node script (ARGV: hashes) once on every node holding some of the hashes' block sets.

        Returns (indexes into ``hashes`` that node got, its reply) per node.
        """
        keys = [self.keys.block + h for h in hashes]
        groups = list(self.nodes.group(keys).values())
        replies = self.fan_out([functools.partial(self.scripts.run, c, script, keys[idx[0]],
                                                  [*self.keys.header, *(hashes[i] for i in idx)])
                                for c, idx in groups])
        return [(idx, r) for (_, idx), r in zip(groups, replies)]

    def block_ops(self, inc: bytes, adds: Sequence[bytes], removes: Sequence[bytes]) -> None:
        """Add ``inc`` to the block sets of ``adds`` and take it out of those of ``removes``, node by node."""
        ops = [*adds, *removes]
        if not ops:
            return
        keys = [self.keys.block + h for h in ops]
        n_add = len(adds)

        def call(client: redis.Redis, idx: list[int]) -> Any:
            mine_add = [ops[i] for i in idx if i < n_add]
            mine_rem = [ops[i] for i in idx if i >= n_add]
            return self.scripts.run(client, "block_ops", keys[idx[0]],
                                    [*self.keys.header, inc, len(mine_add), *mine_add, *mine_rem])
        self.fan_out([functools.partial(call, c, idx) for c, idx in self.nodes.group(keys).values()])

    def block_counts(self, incs: Sequence[bytes]) -> list[int]:
        """SCARD of each incarnation's ``wb`` set, one pipeline per node."""
        keys = [self.keys.wb(inc) for inc in incs]
        out = [0] * len(keys)
        for client, idx in self.nodes.group(keys).values():
            pipe = client.pipeline(transaction=False)
            for i in idx:
                pipe.scard(keys[i])
            for i, n in zip(idx, pipe.execute()):
                out[i] = n
        return out

    def wb_write(self, inc: bytes, adds: Sequence[bytes], removes: Sequence[bytes], count: bool) -> int:
        """Node-batched block writes for one incarnation; returns its block count when ``count``.

        ``wb`` grows before and shrinks after the block sets, so after any
        failure ``wb`` still names every block set that holds ``inc`` and the
        sweeper can find them. Idempotent (set adds/removes of a net effect).
        """
        wb = self.keys.wb(inc)
        _, client = self.nodes.node(wb)
        for chunk in _chunks(adds):
            client.sadd(wb, *chunk)
        self.block_ops(inc, adds, removes)
        pipe = client.pipeline(transaction=False)
        for chunk in _chunks(removes):
            pipe.srem(wb, *chunk)
        if count:
            pipe.scard(wb)
        replies = pipe.execute() if len(pipe) else []
        return int(replies[-1]) if count else 0

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=False)
                self._pool = None
        self.scripts.close()
        self.nodes.close()


class _OnKeyspace(Protocol):
    space: RedisKeyspace


def command(retry: bool = True) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Wrap a method of an object with a ``space`` (:class:`RedisKeyspace`): Redis failures become
    StoreUnavailable; with ``retry``, the whole call is rerun once on Cluster (the call must be idempotent)."""
    def wrap(method: Callable[P, R]) -> Callable[P, R]:
        @functools.wraps(method)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            owner: _OnKeyspace = args[0]  # type: ignore[assignment]
            space = owner.space
            try:
                if retry:
                    return space.nodes.retrying(lambda: method(*args, **kwargs))
                return method(*args, **kwargs)
            except REDIS_ERRORS as e:
                raise space.unavailable(e) from e
        return call
    return wrap


def _chunks(items: Sequence[bytes], size: int = 4096) -> Iterable[Sequence[bytes]]:
    for i in range(0, len(items), size):
        yield items[i:i + size]
