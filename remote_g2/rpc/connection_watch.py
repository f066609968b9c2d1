"""Whether a ZMQ socket's connections are up, from libzmq's own connection events and ZMTP heartbeats.

A server that is killed has its TCP connections closed by the kernel at
once; libzmq reports that as ``EVENT_DISCONNECTED`` within milliseconds,
and every reconnect attempt after as a refused connect
(``EVENT_CONNECT_RETRIED``). A server that hangs without dying (SIGSTOP, a
host gone quiet) keeps its connections open: ZMTP heartbeats
(``ZMQ_HEARTBEAT_IVL``/``_TIMEOUT``, answered by the peer's libzmq I/O
thread, not its application) close such a connection after
``heartbeat_s``, which libzmq again reports as ``EVENT_DISCONNECTED``.
:class:`ConnectionWatch` turns those events into a state per endpoint, so a
caller learns of a death without waiting out a request timeout:

* ``up``: the last event was a completed ZMTP handshake;
* ``down``: the last event was a lost connection, a failed connect or a
  failed handshake (a TCP connect alone does not count: a stopped process's
  kernel still accepts connections it will never greet);
* ``unknown``: nothing seen yet (a fresh socket, a connect in progress).

Without an endpoint, :meth:`~ConnectionWatch.state` and
:meth:`~ConnectionWatch.lost` answer for the socket's connections taken
together (the last event of any of them; every loss): what a socket that
connects to one endpoint wants, whatever form libzmq reports its address in.

``lost(endpoint)`` counts the times a connection that was up went down: a
caller that notes it before sending a request knows, when it changed, that
the request's reply can no longer come (the connection it went out on is
gone). Liveness is kept apart from request timeouts: a server that is up
but slow is still waited for.

Not thread-safe: the owner of the socket polls the watch (:attr:`socket`)
and calls :meth:`drain` on the same thread (or under the same lock).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..errors import ConfigError

__all__ = ["ConnectionWatch", "Liveness", "DEFAULT_HEARTBEAT_S", "HEARTBEAT_ENV"]

DEFAULT_HEARTBEAT_S = 1.0
HEARTBEAT_ENV = "REMOTE_G2_REGISTRY_HEARTBEAT_S"

_UP = zmq.EVENT_HANDSHAKE_SUCCEEDED
_DOWN = (zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_CLOSED
         | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
         | zmq.EVENT_HANDSHAKE_FAILED_AUTH)
_WATCHED = _UP | _DOWN
_ANY = ""  # the key of the socket's connections taken together


@dataclass(frozen=True, slots=True)
class Liveness:
    """How fast a hung peer is given up: ``heartbeat_s`` from its last sign of life (ZMTP PING/PONG).

    A PING goes out every ``heartbeat_s / 2`` and a connection that then stays
    silent for another ``heartbeat_s / 2`` is closed, so a peer that stops
    answering is dropped within ``heartbeat_s``. A ZMTP handshake that has not
    completed after ``max(heartbeat_s, 1 s)`` is dropped too (a stopped peer's
    kernel still accepts the TCP connection).
    """

    heartbeat_s: float = DEFAULT_HEARTBEAT_S

    def __post_init__(self) -> None:
        if not 0.02 <= self.heartbeat_s <= 3600:
            raise ConfigError(f"heartbeat must be between 0.02 s and 1 h, not {self.heartbeat_s} s")

    @classmethod
    def from_env(cls, heartbeat_s: float | None = None) -> Liveness:
        """``heartbeat_s`` if given, else ``REMOTE_G2_REGISTRY_HEARTBEAT_S``, else the default (1 s)."""
        if heartbeat_s is None:
            raw = os.environ.get(HEARTBEAT_ENV, "").strip()
            try:
                heartbeat_s = float(raw) if raw else DEFAULT_HEARTBEAT_S
            except ValueError:
                raise ConfigError(f"{HEARTBEAT_ENV}={raw!r} is not a number of seconds") from None
        return cls(heartbeat_s)

    def apply(self, sock: zmq.Socket) -> None:
        """Set the heartbeat options on ``sock``; before it connects (they apply to new connections)."""
        half_ms = max(10, int(self.heartbeat_s * 500))
        sock.setsockopt(zmq.HEARTBEAT_IVL, half_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, half_ms)
        sock.setsockopt(zmq.HANDSHAKE_IVL, max(1000, 2 * half_ms))


class ConnectionWatch:
    """The connection state of every endpoint ``sock`` connects to; see the module docstring."""

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self.socket: zmq.Socket = sock.get_monitor_socket(_WATCHED)
        self._state: dict[str, str] = {}
        self._since: dict[str, float] = {}
        self._lost: dict[str, int] = {}
        self._closed = False

    def drain(self) -> list[tuple[str, str]]:
        """Read every event waiting; returns ``(endpoint, "up"|"down")`` for each state change, in order."""
        changes: list[tuple[str, str]] = []
        while not self._closed:
            try:
                raw = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            event = parse_monitor_message(raw)
            endpoint = event["endpoint"].decode() if isinstance(event["endpoint"], bytes) else str(event["endpoint"])
            new = "up" if event["event"] == _UP else "down"
            for key in (endpoint, _ANY):
                old = self._state.get(key, "unknown")
                if new == old:
                    continue
                if old == "up":
                    self._lost[key] = self._lost.get(key, 0) + 1
                self._state[key] = new
                self._since[key] = time.monotonic()
                if key == endpoint:
                    changes.append((endpoint, new))
        return changes

    def state(self, endpoint: str | None = None) -> str:
        """``up``, ``down`` or ``unknown`` as of the last :meth:`drain` (None: of the last event of any)."""
        return self._state.get(_ANY if endpoint is None else endpoint, "unknown")

    def down_for_s(self, endpoint: str | None = None) -> float:
        """Seconds since ``endpoint`` (None: any) went down; 0 when it is not down."""
        key = _ANY if endpoint is None else endpoint
        if self._state.get(key) != "down":
            return 0.0
        return time.monotonic() - self._since[key]

    def lost(self, endpoint: str | None = None) -> int:
        """How many times a connection to ``endpoint`` (None: to any) that was up went down, as of the last drain."""
        return self._lost.get(_ANY if endpoint is None else endpoint, 0)

    def forget(self, endpoint: str) -> None:
        """Drop what is known of ``endpoint`` (the socket disconnected from it on purpose)."""
        self._state.pop(endpoint, None)
        self._since.pop(endpoint, None)

    def close(self) -> None:
        """Stop monitoring and close the monitor socket (before the watched socket is closed); idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.socket.close(0)
