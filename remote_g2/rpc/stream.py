"""RPC over a plain TCP stream (``tcp+stream://HOST:PORT``): the lane for calls on a load's critical path.

A peer-resolved load makes one RPC per target rank before its READ can
start (``peer_resolve``, docs/target.md), so that round trip is part of
every load's fixed cost. Over ZMQ each direction passes through the sender's
and the receiver's I/O threads: four extra thread wake-ups per call, which on
a small host cost more than the handler (``bench/rpc/bench_peer_lane.py``;
docs/benchmarks.md, "peer lane").
This lane carries the same frames on a TCP connection read and written by
the threads that use them.

Contract (same as the ZMQ transport unless said otherwise):

* frames: the :mod:`remote_g2.protocol.wire` RPC frames, each preceded by its length
  (:func:`~remote_g2.protocol.wire.stream_frame`); many calls share one connection,
  replies are matched by ``re`` and may come in any order;
* :class:`StreamRpcServer` is an :class:`~remote_g2.rpc.server.RpcServer`:
  same handlers, validation, ``ERR`` replies and ``on_call`` metrics, served
  by one thread that polls the listening socket and every connection. A
  frame that fails validation is answered ``ERR`` and the connection stays
  up; an announced length over the frame limit is answered ``ERR`` (no
  ``re``: its id was never read) and that connection is closed, because the
  stream cannot be resynchronised. ``ctx.identity`` is drawn for each
  accepted connection (:mod:`remote_g2.rpc.connection_identity`), so a lease
  pinned on one connection can be ended only from that connection, and no
  client of any transport can present it; ``ctx.peer`` only routes replies;
* a client that stops reading has its replies queued up to
  ``max_frame_bytes``; past that its connection is closed;
* :class:`StreamConnection` is the client's end (used by
  :class:`~remote_g2.rpc.mux.RpcMux` and :class:`~remote_g2.rpc.client.RpcClient`):
  non-blocking, with an outbox for what the kernel did not take yet (a
  connect still in progress, a full send buffer). A connection that fails is
  closed: callers fail the calls open on it and connect again on the next;
* no CURVE: the lane is plaintext. Services offer it only when CURVE is off,
  and a client configured with CURVE refuses to use it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import select
import socket
import time
from collections.abc import Mapping
from typing import Any

from remote_g2.rpc.connection_identity import new_identity, peer_is_local
from remote_g2.errors import ConfigError, ProtocolError, RpcClosed, TransportError
from remote_g2.rpc.server import Handler, RpcServer, free_port_on_host_of
from remote_g2.protocol.wire import DEFAULT_MAX_FRAME_BYTES, encode_err, read_stream, stream_frame, take_stream_frames

__all__ = ["STREAM_SCHEME", "StreamRpcServer", "StreamConnection", "is_stream_endpoint",
           "parse_stream_endpoint", "stream_endpoint_on_host_of"]

log = logging.getLogger("remote_g2.rpc")

STREAM_SCHEME = "tcp+stream://"
_POLL_MS = 100  # bounds how long close() waits for the serving thread


def is_stream_endpoint(endpoint: str) -> bool:
    return endpoint.startswith(STREAM_SCHEME)


def parse_stream_endpoint(endpoint: str) -> tuple[str, int]:
    """``(host, port)`` of ``tcp+stream://HOST:PORT`` (``[v6]`` brackets removed); ConfigError otherwise."""
    if not is_stream_endpoint(endpoint):
        raise ConfigError(f"{endpoint!r} is not a {STREAM_SCHEME} endpoint")
    host, sep, port = endpoint[len(STREAM_SCHEME):].rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ConfigError(f"{endpoint!r}: expected {STREAM_SCHEME}HOST:PORT")
    return host.strip("[]"), int(port)


def stream_endpoint_on_host_of(endpoint: str) -> str:
    """``tcp+stream://HOST:0`` for the host of ``tcp://HOST:PORT``: a stream lane beside a ZMQ endpoint."""
    host = free_port_on_host_of(endpoint)[len("tcp://"):-len(":0")]  # checks the scheme too
    return f"{STREAM_SCHEME}{'0.0.0.0' if host == '*' else host}:0"


def _tcp_socket(host: str, port: int) -> tuple[socket.socket, Any]:
    # getaddrinfo blocks for a name lookup, on the caller's thread: sources advertise addresses, not names.
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    return sock, addr


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # frames are small and each one is awaited
    sock.setblocking(False)


class StreamConnection:
    """The client's end of one stream-lane connection; not thread-safe (one thread owns it)."""

    def __init__(self, endpoint: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.endpoint = endpoint
        self._max_frame = max_frame_bytes
        host, port = parse_stream_endpoint(endpoint)
        try:
            self._sock, addr = _tcp_socket(host, port)
        except OSError as e:
            raise TransportError(f"{endpoint}: {e}") from None
        _tune(self._sock)
        err = self._sock.connect_ex(addr)  # non-blocking: usually done at once on a LAN, else finished later
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN):
            self._sock.close()
            raise TransportError(f"{endpoint}: cannot connect: {errno.errorcode.get(err, err)}")
        self._out = bytearray()
        self._in = bytearray()
        self.closed = False

    def fileno(self) -> int:
        return -1 if self.closed else self._sock.fileno()

    @property
    def wants_write(self) -> bool:
        """Bytes wait in the outbox: poll for writability and call :meth:`flush`."""
        return bool(self._out)

    def send(self, frame: bytes) -> None:
        """Queue ``frame`` and write what the kernel takes now; :class:`TransportError` when the connection failed."""
        if self.closed:
            raise RpcClosed(f"{self.endpoint}: the connection is closed")
        if len(self._out) > self._max_frame:
            raise TransportError(f"{self.endpoint}: the server has not read {len(self._out)} bytes")
        self._out += stream_frame(frame)
        self.flush()

    def flush(self) -> None:
        """Write as much of the outbox as the socket takes without blocking."""
        while self._out:
            try:
                n = self._sock.send(self._out, socket.MSG_NOSIGNAL)
            except BlockingIOError:
                return
            except OSError as e:
                self.close()
                raise TransportError(f"{self.endpoint}: {e}") from None
            del self._out[:n]

    def receive(self) -> list[bytes]:
        """Every whole frame that has arrived (raw); never blocks. TransportError once the server is gone."""
        if self.closed:
            raise RpcClosed(f"{self.endpoint}: the connection is closed")
        try:
            eof = read_stream(self._sock, self._in)
        except OSError as e:
            self.close()
            raise TransportError(f"{self.endpoint}: {e}") from None
        try:
            frames = take_stream_frames(self._in, max_frame_bytes=4 * self._max_frame)
        except ProtocolError as e:
            self.close()
            raise TransportError(f"{self.endpoint}: {e}") from None
        if eof and not frames:
            self.close()
            raise TransportError(f"{self.endpoint}: the server closed the connection")
        return frames

    def wait(self, events: int, timeout_s: float) -> bool:
        """Block until readable (``select.POLLIN``) or writable (``select.POLLOUT``), or ``timeout_s`` passed."""
        poller = select.poll()
        poller.register(self._sock.fileno(), events)
        return bool(poller.poll(max(0.0, timeout_s) * 1000.0))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._sock.close()


class _ServerSide:
    """One accepted connection on the server: its reply route (``ctx.peer``), identity, input and reply buffers."""

    __slots__ = ("sock", "peer", "identity", "inbox", "outbox", "closing", "dead")

    def __init__(self, sock: socket.socket, peer: bytes) -> None:
        self.sock = sock
        self.peer = peer
        self.identity = new_identity(local=peer_is_local(sock))
        self.inbox = bytearray()
        self.outbox = bytearray()
        self.closing = False  # close once the outbox is written (after a frame we could not resynchronise past)
        self.dead = False     # the client is gone or the socket failed: close it (only _drop closes sockets)


class StreamRpcServer(RpcServer):
    """An :class:`~.server.RpcServer` on ``tcp+stream://HOST:PORT`` (port 0: any); see the module docstring."""

    def __init__(self, endpoint: str, handlers: Mapping[str, Handler], *, name: str = "remote-g2",
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, on_call: Any = None, max_batch: int = 64,
                 backlog: int = 256) -> None:
        self._host, self._port = parse_stream_endpoint(endpoint)
        super().__init__(endpoint, handlers, name=name, workers=1, max_frame_bytes=max_frame_bytes,
                         on_call=on_call, max_batch=max_batch)
        self._backlog = backlog
        self._listener: socket.socket | None = None
        self._conn_ids = itertools.count(1)

    def start(self) -> str:
        if self._listener is not None:
            raise ConfigError("server already started")
        try:
            listener, addr = _tcp_socket(self._host, self._port)
        except OSError as e:
            raise ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}") from None
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(addr)
            listener.listen(self._backlog)
        except OSError as e:
            listener.close()
            raise ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}") from None
        listener.setblocking(False)
        self._listener = listener
        host, port = listener.getsockname()[:2]
        self._bound = f"{STREAM_SCHEME}{f'[{host}]' if ':' in host else host}:{port}"
        self._spawn(self._serve_stream, f"{self.name}-rpc", listener)
        log.info("%s serving on %s (stream lane)", self.name, self._bound)
        return self._bound

    def close(self, timeout: float = 5.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        for t in self._threads:
            t.join(timeout)
        log.info("%s stopped", self.name)

    # -- the serving thread ----------------------------------------------------------------

    def _serve_stream(self, listener: socket.socket) -> None:
        poller = select.poll()
        poller.register(listener.fileno(), select.POLLIN)
        conns: dict[int, _ServerSide] = {}
        by_peer: dict[bytes, _ServerSide] = {}
        try:
            while not self._stopping.is_set():
                batch: list[tuple[bytes | None, list[bytes]]] = []
                for fd, ev in poller.poll(_POLL_MS):
                    if fd == listener.fileno():
                        self._accept(listener, poller, conns, by_peer)
                        continue
                    conn = conns.get(fd)
                    if conn is None:
                        continue
                    if ev & select.POLLOUT:
                        self._write(conn)
                    if ev & (select.POLLIN | select.POLLHUP | select.POLLERR) and not (conn.closing or conn.dead):
                        batch.extend(self._read(conn))
                if batch:
                    replies, deferred = self._dispatch(batch)
                    for d in deferred:  # a stream server answers a deferred batch before it reads on
                        replies.extend(self._settle(*d))
                    for peer, reply in replies:
                        conn = by_peer.get(peer)
                        if conn is not None and not conn.dead:
                            conn.outbox += stream_frame(reply)
                            self._write(conn)
                for fd, conn in list(conns.items()):  # gone, finished after a bad frame, or over the reply limit
                    if conn.dead or (conn.closing and not conn.outbox):
                        self._drop(fd, conn, poller, conns, by_peer)
                    elif len(conn.outbox) > self._max_frame:
                        log.warning("%s: a client read none of %d bytes of replies; closing its connection",
                                    self.name, len(conn.outbox))
                        self._drop(fd, conn, poller, conns, by_peer)
                    else:
                        poller.modify(fd, select.POLLIN | (select.POLLOUT if conn.outbox else 0))
        finally:
            for fd, conn in list(conns.items()):
                self._drop(fd, conn, poller, conns, by_peer)
            listener.close()

    def _accept(self, listener: socket.socket, poller: Any, conns: dict[int, _ServerSide],
                by_peer: dict[bytes, _ServerSide]) -> None:
        while True:
            try:
                sock, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # out of descriptors, say: the clients see their connect fail
                log.warning("%s: accept failed: %s", self.name, e)
                return
            _tune(sock)
            conn = _ServerSide(sock, b"s" + next(self._conn_ids).to_bytes(8, "big"))
            conns[sock.fileno()] = conn
            by_peer[conn.peer] = conn
            poller.register(sock.fileno(), select.POLLIN)

    def _read(self, conn: _ServerSide) -> list[tuple[bytes | None, list[bytes]]]:
        """The requests that arrived whole on ``conn``, as ``(identity, [peer, frame])`` for :meth:`_dispatch`."""
        try:
            conn.dead = read_stream(conn.sock, conn.inbox)  # gone: what it sent before still runs (a last release)
        except OSError:
            conn.dead = True
        try:
            frames = take_stream_frames(conn.inbox, max_frame_bytes=self._max_frame)
        except ProtocolError as e:
            # Answered without ``re`` (its id was never read), then closed: nothing after it can be framed.
            self._observe("?", time.perf_counter(), "bad_request")
            self.note_malformed(f"{e.message} (connection closed: the stream cannot be resynchronised)")
            conn.outbox += stream_frame(encode_err(next(self._ids), None, type(e).__name__, e.message))
            conn.inbox.clear()
            conn.closing = True
            return []
        return [(conn.identity, [conn.peer, f]) for f in frames]

    def _write(self, conn: _ServerSide) -> None:
        while conn.outbox and not conn.dead:
            try:
                n = conn.sock.send(conn.outbox, socket.MSG_NOSIGNAL)
            except BlockingIOError:
                return
            except OSError:
                conn.dead = True
                return
            del conn.outbox[:n]

    @staticmethod
    def _drop(fd: int, conn: _ServerSide, poller: Any, conns: dict[int, _ServerSide],
              by_peer: dict[bytes, _ServerSide]) -> None:
        try:
            poller.unregister(fd)
        except KeyError:
            pass
        conn.sock.close()
        conns.pop(fd, None)
        by_peer.pop(conn.peer, None)
