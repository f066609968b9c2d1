"""Many RPCs in flight from one thread: :class:`RpcMux`, the event loop of a coordinator.

``RpcClient.call`` blocks its thread for a round trip; a coordinator that
drives many requests (the target leader: lookups, resolves, fan-out to its
ranks, releases, renewals) must not. An :class:`RpcMux` sends a request and
returns at once; the reply, or the error the call ended with, reaches the
callback given with it, on the thread that runs :meth:`RpcMux.run_once`::

    mux = RpcMux(timeout_ms=2000)
    mux.call("tcp://10.0.0.8:7460", Resolve(...), on_resolved)   # returns at once
    mux.watch(wake_fd, drain_my_queue)                            # other things to wake for
    while running:
        mux.run_once(timeout_ms=until_my_next_clock)              # callbacks run here

Contract:

* every call's callback runs exactly once, with the validated reply
  dataclass or an exception: the remote ``ERR`` as the error class of that
  name (as :class:`~remote_g2.rpc.client.RpcClient` raises it),
  :class:`~remote_g2.errors.RpcTimeout` naming the call and endpoint when no
  reply came within its timeout, :class:`~remote_g2.errors.ProtocolError`
  for a reply that fails validation, :class:`~remote_g2.errors.TransportError`
  when the request could not be queued, :class:`~remote_g2.errors.RpcClosed`
  for calls still open at :meth:`close`;
* callbacks run on the loop's thread, never inside :meth:`call` (a callback
  may start new calls); a callback that raises is logged and the loop goes on;
* one DEALER socket per endpoint, created on first use; a reply that arrives
  after its call timed out is recognised by its id and dropped;
* ``tcp+stream://`` endpoints (:mod:`remote_g2.rpc.stream`) get one plain
  TCP connection each instead, read and written by the loop's thread; when it
  fails, its open calls fail with :class:`~remote_g2.errors.TransportError`
  and the next call connects again. A mux with CURVE refuses such endpoints
  (they would carry the call in the clear).

Not thread-safe: one thread owns a mux (ZMQ sockets are single-threaded).
"""

from __future__ import annotations

import heapq
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import zmq

from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.errors import ProtocolError, RpcClosed, RpcTimeout, TransportError
from remote_g2.protocol.messages import ErrorReply, spec_for_request
from remote_g2.rpc.client import DEFAULT_TIMEOUT_MS, error_from_reply
from remote_g2.rpc.stream import StreamConnection, is_stream_endpoint
from remote_g2.protocol.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    ERR,
    decode_frame,
    decode_reply_body,
    encode_request,
)

__all__ = ["RpcMux", "ReplyCallback"]

log = logging.getLogger("remote_g2.rpc")

ReplyCallback = Callable[[Any], None]  # gets the reply dataclass or an Exception


@dataclass(slots=True)
class _Call:
    request: Any
    callback: ReplyCallback
    deadline: float
    timeout_ms: float


class _Peer:
    """One endpoint's socket (ZMQ DEALER, or a stream-lane connection) and its open calls by message id."""

    __slots__ = ("endpoint", "sock", "conn", "open", "key")

    def __init__(self, endpoint: str, sock: zmq.Socket | None, conn: StreamConnection | None = None) -> None:
        self.endpoint = endpoint
        self.sock = sock
        self.conn = conn
        self.open: dict[int, _Call] = {}
        # What the poller reports this peer as: the ZMQ socket, or the connection's fd (kept: a closed
        # connection's fileno() is -1, and its registration must still be removed).
        self.key: Any = sock if conn is None else conn.fileno()


class RpcMux:
    """Sends requests to any number of endpoints and dispatches their replies; see the module docstring."""

    def __init__(self, *, timeout_ms: float = DEFAULT_TIMEOUT_MS, curve: CurveClientConfig | None = None,
                 context: zmq.Context | None = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 queue_depth: int = 1000) -> None:
        self.timeout_ms = timeout_ms
        self._curve = curve
        self._ctx = context or zmq.Context.instance()
        self._max_frame = max_frame_bytes
        self._hwm = queue_depth
        self._ids = itertools.count(1)
        self._peers: dict[str, _Peer] = {}
        self._by_sock: dict[Any, _Peer] = {}  # poller key (see _Peer.key) -> peer
        self._watched: dict[Any, Callable[[], None]] = {}
        self._poller = zmq.Poller()
        self._clocks: list[tuple[float, int, str]] = []  # (deadline, msg id, endpoint): a min-heap
        self._ready: deque[tuple[ReplyCallback, Any]] = deque()  # outcomes waiting for their callback
        self._closed = False

    # -- calls -----------------------------------------------------------------------------

    def call(self, endpoint: str, request: Any, callback: ReplyCallback, *,
             timeout_ms: float | None = None) -> None:
        """Send ``request`` to ``endpoint`` now; ``callback(reply_or_error)`` runs later in :meth:`run_once`."""
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        name = spec_for_request(type(request)).name
        if self._closed:
            self._ready.append((callback, RpcClosed(f"calling {name} on {endpoint}: the mux is closed")))
            return
        try:
            peer = self._peer(endpoint)
        except TransportError as e:  # a stream endpoint we cannot connect to, or may not use
            self._ready.append((callback, TransportError(f"calling {name} on {endpoint}: {e}")))
            return
        msg_id = next(self._ids)
        frame = encode_request(msg_id, request)
        if peer.conn is not None:
            try:
                peer.conn.send(frame)
            except (TransportError, RpcClosed) as e:
                self._ready.append((callback, TransportError(f"calling {name} on {endpoint}: {e}")))
                self._lost(peer, str(e))
                return
            self._watch_writes(peer)
        else:
            try:
                peer.sock.send(frame, zmq.NOBLOCK)
            except zmq.ZMQError as e:  # queue full: the peer has not been reading for a while
                self._ready.append((callback, TransportError(f"calling {name} on {endpoint}: {e}")))
                return
        deadline = time.monotonic() + timeout / 1000.0
        peer.open[msg_id] = _Call(request, callback, deadline, timeout)
        heapq.heappush(self._clocks, (deadline, msg_id, endpoint))

    def pending(self) -> int:
        """Calls sent whose callback has not run yet."""
        return sum(len(p.open) for p in self._peers.values()) + len(self._ready)

    def next_deadline(self) -> float | None:
        """The monotonic time the earliest open call times out, if any."""
        clocks = self._clocks
        while clocks:  # drop entries of calls answered or dropped since (the heap keeps them lazily)
            _, msg_id, endpoint = clocks[0]
            peer = self._peers.get(endpoint)
            if peer is not None and msg_id in peer.open:
                return clocks[0][0]
            heapq.heappop(clocks)
        return None

    # -- the loop ----------------------------------------------------------------------------

    def watch(self, source: Any, on_readable: Callable[[], None]) -> None:
        """Also wake for ``source`` (a ZMQ socket or an int file descriptor) and call ``on_readable()``."""
        self._watched[source] = on_readable
        self._poller.register(source, zmq.POLLIN)

    def unwatch(self, source: Any) -> None:
        """Stop waking for ``source`` (as given to :meth:`watch`); unknown sources are ignored."""
        if self._watched.pop(source, None) is not None:
            self._poller.unregister(source)

    def run_once(self, timeout_ms: float) -> None:
        """Wait up to ``timeout_ms`` (less when a call times out sooner) and run every callback due."""
        self._run_ready()
        wait = max(0.0, timeout_ms)
        nxt = self.next_deadline()
        if nxt is not None:
            wait = min(wait, max(0.0, (nxt - time.monotonic()) * 1000.0))
        for source, events in self._poller.poll(wait if wait > 0 else 0):
            peer = self._by_sock.get(source)
            if peer is not None and peer.conn is not None:
                self._stream_ready(peer, events)
            elif peer is not None:
                self._read(peer)
            else:
                handler = self._watched.get(source)
                if handler is not None:
                    self._safely(handler)
        self._expire(time.monotonic())
        self._run_ready()

    def forget(self, endpoint: str) -> None:
        """Close the socket to ``endpoint``; its open calls fail with :class:`RpcClosed` (on the next loop)."""
        peer = self._peers.pop(endpoint, None)
        if peer is None:
            return
        self._drop(peer, "the connection was dropped")

    def close(self) -> None:
        """Close every socket and run the callbacks of the calls still open (with :class:`RpcClosed`)."""
        if self._closed:
            return
        self._closed = True
        for peer in list(self._peers.values()):
            self._drop(peer, "the mux is closed")
        self._peers.clear()
        self._clocks.clear()
        self._run_ready()

    # -- internals ------------------------------------------------------------------------------

    def _peer(self, endpoint: str) -> _Peer:
        peer = self._peers.get(endpoint)
        if peer is None and is_stream_endpoint(endpoint):
            if self._curve is not None:
                raise TransportError("CURVE is configured and a stream endpoint would carry the call in the clear")
            conn = StreamConnection(endpoint, max_frame_bytes=self._max_frame)
            peer = self._peers[endpoint] = _Peer(endpoint, None, conn)
            self._by_sock[peer.key] = peer
            self._poller.register(peer.key, zmq.POLLIN)
        elif peer is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = sock.rcvhwm = self._hwm
            sock.maxmsgsize = 4 * self._max_frame
            if self._curve is not None and endpoint.startswith("tcp://"):  # IPC peers are private, never CURVE
                self._curve.apply(sock)
            sock.connect(endpoint)
            peer = self._peers[endpoint] = _Peer(endpoint, sock)
            self._by_sock[sock] = peer
            self._poller.register(sock, zmq.POLLIN)
        return peer

    def _drop(self, peer: _Peer, why: str, error: type[Exception] = RpcClosed) -> None:
        key = peer.key
        self._poller.unregister(key)
        self._by_sock.pop(key, None)
        if peer.conn is not None:
            peer.conn.close()
        else:
            peer.sock.close(0)
        for call in peer.open.values():
            name = type(call.request).WIRE_NAME
            self._ready.append((call.callback, error(f"calling {name} on {peer.endpoint}: {why}")))
        peer.open.clear()

    def _lost(self, peer: _Peer, why: str) -> None:
        """A stream connection failed: fail its open calls; the next call to its endpoint connects again."""
        if self._peers.get(peer.endpoint) is peer:
            del self._peers[peer.endpoint]
            self._drop(peer, why, TransportError)

    def _watch_writes(self, peer: _Peer) -> None:
        assert peer.conn is not None
        self._poller.modify(peer.key, zmq.POLLIN | (zmq.POLLOUT if peer.conn.wants_write else 0))

    def _stream_ready(self, peer: _Peer, events: int) -> None:
        assert peer.conn is not None
        try:
            if events & zmq.POLLOUT:
                peer.conn.flush()
                self._watch_writes(peer)
            raws = peer.conn.receive() if events & (zmq.POLLIN | zmq.POLLERR) else []
        except (TransportError, RpcClosed) as e:
            self._lost(peer, str(e))
            return
        for raw in raws:
            self._take_reply(peer, raw)

    def _read(self, peer: _Peer) -> None:
        while True:
            try:
                raw = peer.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._take_reply(peer, raw)

    def _take_reply(self, peer: _Peer, raw: bytes) -> None:
        try:
            frame = decode_frame(raw, max_frame_bytes=self._max_frame)
        except ProtocolError as e:
            log.warning("dropping an unreadable reply from %s: %s", peer.endpoint, e)
            return
        if frame.re is None:
            # An ERR without ``re``: the server could not read our id. With several calls
            # open nobody knows which one it is about; each of them will time out.
            if frame.type == ERR and len(peer.open) == 1:
                self._settle(peer, next(iter(peer.open)), frame)
            return
        if frame.re in peer.open:
            self._settle(peer, frame.re, frame)
        # otherwise a late reply to a call that already timed out

    def _settle(self, peer: _Peer, msg_id: int, frame: Any) -> None:
        call = peer.open.pop(msg_id)
        try:
            body = decode_reply_body(frame, spec_for_request(type(call.request)))
        except ProtocolError as e:
            outcome: Any = e
        else:
            outcome = error_from_reply(body, peer.endpoint) if isinstance(body, ErrorReply) else body
        self._ready.append((call.callback, outcome))

    def _expire(self, now: float) -> None:
        while self._clocks and self._clocks[0][0] <= now:
            _, msg_id, endpoint = heapq.heappop(self._clocks)
            peer = self._peers.get(endpoint)
            call = peer.open.pop(msg_id, None) if peer is not None else None
            if call is None:
                continue  # answered already
            name = type(call.request).WIRE_NAME
            self._ready.append((call.callback, RpcTimeout(
                f"calling {name} on {endpoint}: no reply within {call.timeout_ms:g} ms",
                call=name, endpoint=endpoint, timeout_ms=call.timeout_ms)))

    def _run_ready(self) -> None:
        while self._ready:  # one at a time, so pending() inside a callback counts the ones still to run
            callback, outcome = self._ready.popleft()
            self._safely(callback, outcome)

    @staticmethod
    def _safely(fn: Callable[..., None], *args: Any) -> None:
        try:
            fn(*args)
        except Exception:  # a bug in one callback must not stop the loop
            log.exception("rpc mux: callback %r failed", fn)
