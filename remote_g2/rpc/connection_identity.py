"""Who is calling: one identity per client connection, drawn by the server, that no client can choose.

Leases are bound to the connection that took them (docs/security.md), so
the server needs a name for "this connection" that a client cannot forge.
ZMQ's routing id is not one: a client may set its own (``ZMQ_ROUTING_ID``),
and the ids libzmq assigns are predictable (they count up from the C
library's unseeded ``rand()``), so a client could present the routing id of
a connection that has gone, or of another transport's connection. Instead:

* the server draws 16 random bytes for each connection the first time it
  carries a request, and forgets them when the connection closes;
* over ZMQ a connection is the pair (socket descriptor, routing id) of a
  message (``ZMQ_SRCFD``). The ROUTER's monitor reports every descriptor
  accepted or closed; :meth:`ZmqConnectionIdentities.identify` reads those
  reports *after* the messages it names were received, so a descriptor that
  closed and was taken by a new connection is seen as new even when the new
  connection presents the old routing id. (libzmq reports a close before the
  descriptor can be reused, and an accept before the new connection's first
  message is delivered, so the reports are always there by then.)
* the stream lane draws one per accepted socket
  (:mod:`remote_g2.rpc.stream`);
* with CURVE, the client's public key (ZAP ``User-Id``; an identifying
  server runs a ZAP handler even without an allow-list) is part of the
  identity as well.

Identities never leave the server and are never reused: an owner from one
transport can never equal an owner from another.

An identity also records whether its peer is on this host (its last byte,
:func:`is_local`: a Unix socket, a loopback address, or the address the
connection reached us on), which the source's progress pace reads
(``source/progress_pace.py``). Unknown counts as another host.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import struct
from collections.abc import Sequence

import zmq

__all__ = ["ZmqConnectionIdentities", "is_local", "new_identity", "peer_is_local"]

_LOCAL, _REMOTE = b"l", b"r"

log = logging.getLogger("remote_g2.rpc")

_MONITORED = zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED


def new_identity(key: bytes = b"", *, local: bool = False) -> bytes:
    """A fresh connection identity: 16 random bytes (after the client's CURVE key when there is one), then locality."""
    token = secrets.token_bytes(16) + (_LOCAL if local else _REMOTE)
    return key + b"/" + token if key else token


def is_local(identity: bytes) -> bool:
    """Whether the connection ``identity`` names came from this host (see the module docstring)."""
    return identity.endswith(_LOCAL)


def peer_is_local(sock: socket.socket) -> bool:
    """Whether a connected socket's peer is on this host: Unix socket, loopback, or our own address."""
    try:
        if sock.family == socket.AF_UNIX:
            return True
        peer, own = sock.getpeername()[0], sock.getsockname()[0]
    except OSError:
        return False
    return peer == own or peer.startswith("127.") or peer in ("::1", "::ffff:127.0.0.1")


def _fd_peer_is_local(fd: int) -> bool:
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            return peer_is_local(sock)
    except OSError:
        return False


class ZmqConnectionIdentities:
    """The identities of the connections of one ROUTER socket; used by the one thread that reads it.

    Create it before the socket binds (so that no accept goes unreported)
    and :meth:`close` it before the socket.
    """

    def __init__(self, sock: zmq.Socket) -> None:
        self._sock = sock
        self._monitor = sock.get_monitor_socket(_MONITORED)
        self._by_fd: dict[int, tuple[bytes, bytes]] = {}  # descriptor -> (routing id, identity)

    def identify(self, messages: Sequence[Sequence[zmq.Frame]]) -> list[bytes]:
        """The identity of each received message's connection (``messages[i][0]`` is its routing-id frame)."""
        self._refresh()
        out = []
        for frames in messages:
            routing_id = frames[0].bytes
            try:
                fd = frames[0].get(zmq.SRCFD)
            except zmq.ZMQError:
                fd = -1
            known = self._by_fd.get(fd)
            if known is not None and known[0] == routing_id:
                out.append(known[1])
                continue
            identity = new_identity(_client_key(frames[0]), local=fd >= 0 and _fd_peer_is_local(fd))
            if fd >= 0:
                self._by_fd[fd] = (routing_id, identity)
            else:  # no descriptor to tie it to: an identity for this message alone (its owner cannot end it)
                log.warning("a message without a source descriptor; its connection gets a one-off identity")
            out.append(identity)
        return out

    @property
    def connections(self) -> int:
        """Connections with an identity now."""
        return len(self._by_fd)

    def _refresh(self) -> None:
        """Forget every descriptor the monitor reported accepted or closed since the last call."""
        while True:
            try:
                event = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(event[0]) >= 6:
                _, fd = struct.unpack("=HI", event[0][:6])
                self._by_fd.pop(fd, None)

    def close(self) -> None:
        """Stop monitoring; call from the thread that reads the socket, before closing it."""
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self._monitor.close(0)


def _client_key(frame: zmq.Frame) -> bytes:
    try:
        user = frame.get("User-Id")
    except zmq.ZMQError:
        return b""
    return user.encode() if isinstance(user, str) else bytes(user or b"")
