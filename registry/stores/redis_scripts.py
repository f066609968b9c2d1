"""Lua scripts on Redis by name: ``registry/stores/lua/*.lua`` loaded on first use, run by EVALSHA, pipelined.

The registry's every Redis call is one of these scripts (a lookup is one
EVALSHA), so this is its hot path; see :class:`Scripts` for why it bypasses
redis-py's per-command machinery. Used by the Redis store's modules only.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hiredis
import redis
from redis.connection import Connection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError

_LUA_DIR = Path(__file__).with_name("lua")
_INCLUDE = re.compile(r"^--!include (\S+)$", re.M)


@functools.cache
def _script_sources() -> dict[str, str]:
    """Every ``registry/stores/lua/<name>.lua`` with its ``--!include`` lines expanded (``_*.lua`` are includes)."""
    def expand(m: re.Match[str]) -> str:
        return (_LUA_DIR / m.group(1)).read_text()
    return {p.stem: _INCLUDE.sub(expand, p.read_text())
            for p in sorted(_LUA_DIR.glob("*.lua")) if not p.stem.startswith("_")}


class Scripts:
    """EVALSHA by name; on NOSCRIPT (new server, failover, SCRIPT FLUSH) load the script there and retry.

    Every script call is on the hot path (a lookup is one EVALSHA), so it skips
    redis-py's per-command machinery: the command is packed in C by hiredis and
    sent on a connection taken from a plain per-node free list (list pop and
    append are atomic; no pool bookkeeping, no condition variable). A socket
    that died with a restarted server costs one immediate retry on a fresh
    connection, as the pooled commands' ``Retry`` does.
    """

    def __init__(self) -> None:
        self._src = _script_sources()
        self._sha = {name: hashlib.sha1(src.encode()).hexdigest() for name, src in self._src.items()}
        self._idle: weakref.WeakKeyDictionary[redis.Redis, list[Connection]] = weakref.WeakKeyDictionary()
        self._made: list[Connection] = []  # every connection made, for close()
        self._lock = threading.Lock()

    def run(self, client: redis.Redis, name: str, key: bytes, args: Sequence[Any]) -> Any:
        return self.run_many(client, name, key, [args])[0]

    def run_many(self, client: redis.Redis, name: str, key: bytes, arg_lists: Sequence[Sequence[Any]]) -> list[Any]:
        """Run the script once per argument list, pipelined: one write, then every reply in order.

        An error reply raises (after every reply was read, so the connection
        stays in step); NOSCRIPT loads the script and reruns those calls.
        """
        return self.start_many(client, name, key, arg_lists).result()

    def start_many(self, client: redis.Redis, name: str, key: bytes,
                   arg_lists: Sequence[Sequence[Any]]) -> PendingScripts:
        """Send the calls now (one write) and return at once; ``.result()`` reads the replies.

        The connection stays checked out until ``result()`` returns, so any
        number of these can be on the wire at once, each on its own socket
        (``fileno()``, for a poller to wait on).
        """
        sha = self._sha[name]
        packed = [hiredis.pack_command(("EVALSHA", sha, 1, key, *args)) for args in arg_lists]
        idle, conn = self._checkout(client)
        try:
            try:
                self._send(conn, packed)
            except RedisConnectionError:  # a socket that died with a restarted server
                conn.disconnect()
                self._send(conn, packed)
        except BaseException:
            idle.append(conn)
            raise
        return PendingScripts(self, client, name, idle, conn, packed)

    def _checkout(self, client: redis.Redis) -> tuple[list[Connection], Connection]:
        idle = self._idle.get(client)
        if idle is None:
            with self._lock:
                idle = self._idle.setdefault(client, [])
        try:
            return idle, idle.pop()
        except IndexError:
            pool = client.connection_pool
            conn = pool.connection_class(**pool.connection_kwargs)
            with self._lock:
                self._made.append(conn)
            return idle, conn

    @classmethod
    def _round_trip(cls, conn: Connection, packed: list[bytes]) -> list[Any]:
        """Send the packed commands in one write and read as many replies (errors as values)."""
        try:
            cls._send(conn, packed)
            return cls._read(conn, len(packed))
        except RedisConnectionError:
            conn.disconnect()
        cls._send(conn, packed)
        return cls._read(conn, len(packed))

    @staticmethod
    def _send(conn: Connection, packed: list[bytes]) -> None:
        if conn._sock is None:  # connect() first: a Sentinel-managed connection asks the sentinels there
            conn.connect()
        conn.send_packed_command([b"".join(packed)] if len(packed) > 1 else packed, check_health=False)

    @staticmethod
    def _read(conn: Connection, n: int) -> list[Any]:
        replies: list[Any] = []
        for _ in range(n):
            try:
                replies.append(conn.read_response())
            except ResponseError as e:  # a whole reply was read; the stream is still in step
                replies.append(e)
        return replies

    def close(self) -> None:
        """Disconnect every connection made (a later call reconnects)."""
        with self._lock:
            made = list(self._made)
        for conn in made:
            conn.disconnect()


class PendingScripts:
    """Script calls on the wire (see :meth:`Scripts.start_many`); ``result()`` once, from one thread."""

    def __init__(self, scripts: Scripts, client: redis.Redis, name: str, idle: list[Connection],
                 conn: Connection, packed: list[bytes]) -> None:
        self._scripts, self._client, self._name = scripts, client, name
        self._idle, self._conn, self._packed = idle, conn, packed

    def fileno(self) -> int:
        sock = self._conn._sock
        return sock.fileno() if sock is not None else -1

    def result(self) -> list[Any]:
        conn, packed = self._conn, self._packed
        try:
            try:
                replies = Scripts._read(conn, len(packed))
            except RedisConnectionError:  # the server went away mid-call; the calls are resent once
                conn.disconnect()
                replies = Scripts._round_trip(conn, packed)
            redo = [i for i, r in enumerate(replies) if isinstance(r, NoScriptError)]
            if redo:
                self._client.script_load(self._scripts._src[self._name])
                for i, r in zip(redo, Scripts._round_trip(conn, [packed[i] for i in redo])):
                    replies[i] = r
        finally:
            # Safe to reuse even after an error: redis-py disconnects a connection
            # whose stream it could not finish, and the next send reconnects.
            self._idle.append(conn)
        for r in replies:
            if isinstance(r, ResponseError):
                raise r
        return replies
