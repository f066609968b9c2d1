"""RPC client: one DEALER socket, typed calls, timeouts that name the call.

``client.call(request)`` sends a request dataclass and returns the reply
dataclass the message table pairs with it. An ``ERR`` reply is raised as the
error class of the same name from :mod:`remote_g2.errors` (``remote`` set to
the endpoint), or :class:`~remote_g2.errors.RemoteError` when the name is
unknown here. No reply within the timeout raises
:class:`~remote_g2.errors.RpcTimeout` naming the call and the endpoint.

A DEALER socket (not REQ) means a timed-out call leaves no stuck state: a late
reply is recognised by its ``re`` and discarded. The client is thread-safe;
calls from several threads are serialised on one socket — give a thread its
own client when it needs its own pace.

A ``tcp+stream://`` endpoint (:mod:`remote_g2.rpc.stream`) is called over one
plain TCP connection instead, made on the first call and again on the call
after one that failed; CURVE cannot be used with it.

With ``liveness`` (a :class:`~remote_g2.rpc.connection_watch.Liveness`) the
socket heartbeats and its connection events are watched
(:mod:`remote_g2.rpc.connection_watch`): a call whose connection is lost while
it waits (the server was killed, or stopped answering heartbeats) raises
:class:`~remote_g2.errors.TransportError` at once instead of waiting out its
timeout, since its reply can no longer come. With ``fail_fast=True`` a call
also gives up at once when the connection is known to be down before it is
sent, or a connect attempt fails while it waits (for a caller with another
server to try); without it such a call waits, as a server being started
may still answer in time.
"""

from __future__ import annotations

import itertools
import select
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from remote_g2.rpc.connection_watch import ConnectionWatch, Liveness
from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.errors import ConfigError, RemoteError, RpcClosed, RpcTimeout, TransportError, error_class_for
from remote_g2.protocol.messages import ErrorReply, Ping, Pong, spec_for_request
from remote_g2.rpc.stream import StreamConnection, is_stream_endpoint
from remote_g2.protocol.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    ERR,
    decode_frame,
    decode_reply_body,
    encode_request,
)

__all__ = ["RpcClient", "DEFAULT_TIMEOUT_MS", "error_from_reply"]

DEFAULT_TIMEOUT_MS = 5000.0


def error_from_reply(err: ErrorReply, endpoint: str) -> Exception:
    """The exception an ``ERR`` reply from ``endpoint`` stands for: its class by name, else RemoteError."""
    cls = error_class_for(err.name)
    if cls is None or cls is RemoteError:
        return RemoteError(err.message, name=err.name, remote=endpoint)
    try:
        return cls(err.message, remote=endpoint)
    except TypeError:  # a subclass with a different constructor
        return RemoteError(err.message, name=err.name, remote=endpoint)


class RpcClient:
    """Calls one server endpoint (``tcp://…``, ``ipc://…`` or ``tcp+stream://…``)."""

    def __init__(
        self,
        endpoint: str,
        *,
        timeout_ms: float = DEFAULT_TIMEOUT_MS,
        curve: CurveClientConfig | None = None,
        context: zmq.Context | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        liveness: Liveness | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms
        self._max_frame = max_frame_bytes
        self._stream = is_stream_endpoint(endpoint)
        self._conn: StreamConnection | None = None
        self._sock: zmq.Socket | None = None
        self._watch: ConnectionWatch | None = None
        self._poller: zmq.Poller | None = None
        if self._stream:
            if curve is not None:
                raise ConfigError(f"{endpoint}: a stream endpoint cannot use CURVE")
        else:
            self._sock = (context or zmq.Context.instance()).socket(zmq.DEALER)
            self._sock.linger = 0
            self._sock.maxmsgsize = 4 * max_frame_bytes
            if curve is not None:
                curve.apply(self._sock)
            if liveness is not None:
                liveness.apply(self._sock)
                self._watch = ConnectionWatch(self._sock)
                self._poller = zmq.Poller()
                self._poller.register(self._sock, zmq.POLLIN)
                self._poller.register(self._watch.socket, zmq.POLLIN)
            self._sock.connect(endpoint)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False

    def call(self, request: Any, *, timeout_ms: float | None = None, fail_fast: bool = False) -> Any:
        """Send ``request`` and return its validated reply; see the module docstring for errors."""
        spec = spec_for_request(type(request))
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        with self._lock:
            if self._closed:
                raise RpcClosed(f"calling {spec.name} on {self.endpoint}: client is closed")
            msg_id = next(self._ids)
            deadline = time.monotonic() + timeout / 1000.0
            if self._stream:
                frames = self._stream_call(encode_request(msg_id, request), deadline)
            elif self._watch is not None:
                frames = self._watched_call(encode_request(msg_id, request), deadline, spec.name, fail_fast)
            else:
                frames = self._zmq_call(encode_request(msg_id, request), deadline)
            for raw in frames:
                frame = decode_frame(raw, max_frame_bytes=self._max_frame)
                # An ERR without ``re`` means the server could not read our id; it is
                # about this call. Any other id is a late reply to a timed-out call.
                if frame.re != msg_id and not (frame.re is None and frame.type == ERR):
                    continue
                body = decode_reply_body(frame, spec)
                if isinstance(body, ErrorReply):
                    raise error_from_reply(body, self.endpoint)
                return body
            raise RpcTimeout(f"calling {spec.name} on {self.endpoint}: no reply within {timeout:g} ms",
                             call=spec.name, endpoint=self.endpoint, timeout_ms=timeout)

    def _zmq_call(self, request: bytes, deadline: float) -> Iterator[bytes]:
        """Send ``request``, then yield every frame that arrives until ``deadline``."""
        assert self._sock is not None
        if not self._send_by(request, deadline):
            return
        while True:
            left_ms = (deadline - time.monotonic()) * 1000.0
            if left_ms <= 0 or not self._sock.poll(max(1, int(left_ms)), zmq.POLLIN):
                return
            yield self._sock.recv()

    def _send_by(self, request: bytes, deadline: float) -> bool:
        """Queue ``request`` on the ZMQ socket before ``deadline``; False when it could not be sent by then."""
        assert self._sock is not None
        # Never a blocking send: a DEALER with no usable pipe (a CURVE handshake the
        # server keeps refusing, a full queue) would block it for good, past any deadline.
        left_ms = (deadline - time.monotonic()) * 1000.0
        if not self._sock.poll(max(1, int(left_ms)), zmq.POLLOUT):
            return False
        try:
            self._sock.send(request, zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def connection_state(self) -> str:
        """``up``, ``down`` or ``unknown`` (no liveness watch, or nothing known yet); see :mod:`.connection_watch`."""
        with self._lock:
            if self._watch is None or self._closed:
                return "unknown"
            self._watch.drain()
            return self._watch.state()

    def _watched_call(self, request: bytes, deadline: float, name: str, fail_fast: bool) -> Iterator[bytes]:
        """As :meth:`_zmq_call`, ending early (TransportError) when the connection is lost (module docstring)."""
        assert self._sock is not None and self._watch is not None and self._poller is not None
        # One endpoint per socket: its events are taken together (libzmq may spell the address its own way).
        watch, endpoint = self._watch, self.endpoint
        watch.drain()
        if fail_fast and watch.state() == "down":
            raise TransportError(f"calling {name} on {endpoint}: the connection is down "
                                 f"(for {watch.down_for_s():.1f} s)")
        lost = watch.lost()
        if not self._send_by(request, deadline):
            return
        while True:
            left_ms = (deadline - time.monotonic()) * 1000.0
            if left_ms <= 0:
                return
            ready = dict(self._poller.poll(max(1, int(left_ms))))
            if self._sock in ready:
                yield self._sock.recv()
                continue
            if watch.socket in ready:
                watch.drain()
                if watch.lost() != lost:  # the connection the request went out on is gone
                    raise TransportError(f"calling {name} on {endpoint}: the connection was lost "
                                         "(the server closed it or stopped answering heartbeats)")
                if fail_fast and watch.state() == "down":
                    raise TransportError(f"calling {name} on {endpoint}: cannot connect")

    def _stream_call(self, request: bytes, deadline: float) -> Iterator[bytes]:
        """As :meth:`_zmq_call`, on the stream connection (connected now if there is none)."""
        if self._conn is None or self._conn.closed:
            self._conn = StreamConnection(self.endpoint, max_frame_bytes=self._max_frame)
        conn = self._conn
        conn.send(request)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            if conn.wants_write:
                if conn.wait(select.POLLOUT, left):
                    conn.flush()
                continue
            if conn.wait(select.POLLIN, left):
                yield from conn.receive()  # TransportError once the server is gone

    def ping(self, *, timeout_ms: float | None = None) -> Pong:
        """Ask the server who it is; a cheap liveness check."""
        reply: Pong = self.call(Ping(), timeout_ms=timeout_ms)
        return reply

    def close(self) -> None:
        """Close the socket; idempotent. Later calls raise :class:`RpcClosed`."""
        with self._lock:
            if not self._closed:
                self._closed = True
                if self._watch is not None:
                    self._watch.close()
                if self._sock is not None:
                    self._sock.close(0)
                if self._conn is not None:
                    self._conn.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

