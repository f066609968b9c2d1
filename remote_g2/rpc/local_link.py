"""Worker-internal message links: one Unix stream socket between a worker's leader and each other TP rank.

A worker's TP ranks are processes on one host that already trust each other
(they share the engine). The leader listens on a path in the private IPC
directory; every other rank connects once at start-up and says which rank it
is (``link_hello``); from then on either side sends typed one-way messages
(registered request dataclasses) and reads them when its socket is readable.

Why not ZMQ IPC, which the RPC layer uses: a ZMQ message is handed from the
sending thread to the sender's I/O thread and from the receiver's I/O thread
to the receiving thread — three threads to wake per hop instead of one
(what that costs a round trip: ``bench/rpc/bench_local_link.py``;
docs/benchmarks.md, "local links"). The target's hand-off to its ranks and their
reports sit on every load's critical path.

Contract:

* frames: a 4-byte big-endian length, then one :mod:`remote_g2.protocol.wire` frame of
  at most ``max_frame_bytes``, validated on arrival exactly as an RPC request
  (size first, then envelope, then the body's typed decoder). A frame that
  fails validation raises :class:`~remote_g2.errors.ProtocolError` from
  :meth:`MessageLink.receive` and closes the link: a private socket carrying
  garbage is a bug or an intruder, and nothing after it can be trusted;
* delivery: in order and exactly once while the link is up. A peer that
  exits or crashes is noticed at once — the kernel closes its end, the next
  :meth:`MessageLink.receive` raises :class:`LinkClosed` — so nobody waits for
  a timeout to learn a rank died;
* :meth:`MessageLink.send` writes the whole frame before returning and blocks
  at most ``send_timeout_s`` (only when the peer stopped reading and both
  socket buffers filled); past that the link is broken: :class:`LinkClosed`;
* not thread-safe: one thread owns a link.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import time
from typing import Any

from remote_g2.errors import ConfigError, LinkClosed, ProtocolError, TransportError
from remote_g2.rpc.ipc_paths import claim_ipc_path
from remote_g2.protocol.messages import LinkHello
from remote_g2.protocol.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    decode_frame,
    decode_request_body,
    encode_request,
    read_stream,
    stream_frame,
    take_stream_frames,
)

__all__ = ["MessageLink", "LinkListener", "LinkClosed", "connect_link", "boot_id"]  # LinkClosed: from remote_g2.errors

_SOCK_BUFFER = 4 << 20  # asked for; the kernel caps it at net.core.{r,w}mem_max


class MessageLink:
    """One connected stream socket carrying typed one-way messages both ways; see the module docstring."""

    def __init__(self, sock: socket.socket, peer: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 send_timeout_s: float = 2.0) -> None:
        self.peer = peer
        self._sock = sock
        self._max_frame = max_frame_bytes
        self._send_timeout = send_timeout_s
        self._buf = bytearray()
        self._ids = itertools.count(1)
        self._closed = False
        self._eof = False  # the peer closed its end; raised after what came before is delivered
        self.unread: list[Any] = []  # decoded, not yet handed out (receive() returns these first)
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, _SOCK_BUFFER)
            except OSError:
                pass
        sock.setblocking(False)

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int:
        """The socket's descriptor, to poll for readability (-1 once closed)."""
        return -1 if self._closed else self._sock.fileno()

    def send(self, message: Any) -> None:
        """Write ``message`` (a registered request dataclass) whole; :class:`LinkClosed` if that is impossible."""
        if self._closed:
            raise LinkClosed(f"link to {self.peer} is closed")
        frame = encode_request(next(self._ids), message)
        if len(frame) > self._max_frame:
            raise ProtocolError(f"{type(message).__name__} of {len(frame)} bytes exceeds the "
                                f"{self._max_frame}-byte frame limit")
        data = memoryview(stream_frame(frame))
        deadline: float | None = None
        while data:
            try:
                # MSG_NOSIGNAL: a peer that is gone must not kill an engine that restored SIGPIPE's default.
                n = self._sock.send(data, socket.MSG_NOSIGNAL)
            except BlockingIOError:
                n = 0
            except OSError as e:
                self.close()
                raise LinkClosed(f"link to {self.peer}: {e}") from None
            data = data[n:]
            if data:  # the peer is behind: wait for room, but never past the deadline
                now = time.monotonic()
                deadline = deadline or now + self._send_timeout
                if now >= deadline or not _wait(self._sock.fileno(), select.POLLOUT, deadline - now):
                    self.close()
                    raise LinkClosed(f"link to {self.peer}: the peer read nothing for {self._send_timeout:g} s")

    def receive(self) -> list[Any]:
        """Every complete message that has arrived, decoded and validated; never blocks.

        Raises :class:`LinkClosed` once the peer is gone (after returning what it
        sent before), :class:`~remote_g2.errors.ProtocolError` for a bad frame;
        both close the link.
        """
        if self._eof or self._closed:
            self.close()
            raise LinkClosed(f"link to {self.peer}: " + ("the peer closed it" if self._eof else "closed"))
        try:
            eof = read_stream(self._sock, self._buf)
        except OSError as e:
            self.close()
            raise LinkClosed(f"link to {self.peer}: {e}") from None
        out, self.unread = self.unread + self._decode_buffered(), []
        if eof:
            self._eof = True
            if not out:
                return self.receive()
        return out

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def _decode_buffered(self) -> list[Any]:
        try:
            frames = take_stream_frames(self._buf, max_frame_bytes=self._max_frame)
            return [decode_request_body(decode_frame(f, max_frame_bytes=self._max_frame))[1] for f in frames]
        except ProtocolError:
            self.close()
            raise


class LinkListener:
    """The leader's end: listens on ``path`` (a socket file in a private directory) until closed."""

    def __init__(self, path: str, *, backlog: int = 256) -> None:
        claim_ipc_path(f"ipc://{path}")
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.bind(path)
            self._sock.listen(backlog)
        except OSError as e:
            self._sock.close()
            raise ConfigError(f"cannot listen on {path}: {e}") from e

    def accept_ranks(self, ranks: set[int], worker_id: str, *, timeout_s: float,
                     **link_options: Any) -> dict[int, MessageLink]:
        """Accept one connection from each of ``ranks`` (they announce themselves with ``link_hello``).

        Raises :class:`~remote_g2.errors.TransportError` naming the ranks that
        did not connect within ``timeout_s``, or that announced a wrong worker.
        """
        links: dict[int, MessageLink] = {}
        deadline = time.monotonic() + timeout_s
        pending: list[MessageLink] = []
        try:
            while len(links) < len(ranks):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TransportError(f"worker {worker_id}: rank(s) {sorted(ranks - set(links))} did not "
                                         f"connect to {self.path} within {timeout_s:g} s")
                poller = select.poll()
                by_fd: dict[int, Any] = {self._sock.fileno(): self._sock}
                for link in pending:
                    by_fd[link.fileno()] = link
                for fd in by_fd:
                    poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(left * 1000.0):
                    r = by_fd[fd]
                    if r is self._sock:
                        conn, _ = self._sock.accept()
                        pending.append(MessageLink(conn, f"{self.path} (unidentified)", **link_options))
                        continue
                    link: MessageLink = r
                    pending.remove(link)
                    try:
                        hellos = link.receive()
                    except (TransportError, ProtocolError):
                        continue  # not a rank of ours (a probe, a stray process): forget it
                    if not hellos:
                        pending.append(link)  # the hello is still on its way
                        continue
                    hello, link.unread = hellos[0], hellos[1:]
                    if not isinstance(hello, LinkHello):
                        link.close()
                        continue
                    if hello.worker_id != worker_id or hello.rank not in ranks or hello.rank in links:
                        link.close()
                        raise TransportError(f"worker {worker_id}: a process announced itself on {self.path} as "
                                             f"rank {hello.rank} of worker {hello.worker_id!r}")
                    link.peer = f"rank {hello.rank}"
                    links[hello.rank] = link
        except BaseException:
            for link in [*links.values(), *pending]:
                link.close()
            raise
        for link in pending:
            link.close()
        return links

    def close(self) -> None:
        """Stop listening and remove the socket file (links already accepted stay up)."""
        self._sock.close()
        try:
            os.unlink(self.path)
        except OSError:
            pass


def connect_link(path: str, *, rank: int, worker_id: str, timeout_s: float, **link_options: Any) -> MessageLink:
    """A rank's end: connect to the leader's ``path`` (retrying until ``timeout_s``) and announce ``rank``."""
    deadline = time.monotonic() + timeout_s
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(path)
            break
        except OSError as e:
            sock.close()
            if time.monotonic() >= deadline:
                raise TransportError(f"rank {rank} of worker {worker_id}: cannot connect to {path}: {e}") from None
            time.sleep(0.01)
    link = MessageLink(sock, "the leader", **link_options)
    link.send(LinkHello(worker_id, rank))
    return link


def boot_id() -> str:
    """This host's boot id: processes that share it share a host, and its monotonic clock."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"pid-{os.getpid()}"  # unknown: no other process is assumed to share it


def _wait(fd: int, events: int, timeout_s: float) -> bool:
    """Whether ``fd`` became ready for ``events`` within ``timeout_s`` (poll: no FD_SETSIZE limit)."""
    poller = select.poll()
    poller.register(fd, events)
    return bool(poller.poll(max(0.0, timeout_s) * 1000.0))
