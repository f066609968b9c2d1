"""How an :class:`~remote_g2.rpc.server.RpcServer` serves its bound ROUTER socket: one object per mode.

* :class:`DirectServing` (``workers=1``): one thread owns the ROUTER, reads
  a batch, hands it to the :class:`~remote_g2.rpc.dispatch.Dispatcher` and
  answers; no thread hand-off per request.
* :class:`PooledServing` (``workers=N>1``): a proxy thread (ZMQ's, in C, or
  a Python one when the server identifies clients) hands requests to N
  handler threads over inproc and carries their replies back.
* :class:`DrivenServing` (``workers=0``): no thread; the owner's loop polls
  the socket and calls :meth:`DrivenServing.serve_ready`.

Why each exists and what it costs: :mod:`remote_g2.rpc.server`'s docstring.
Every mode reads through a :class:`RouterFront` (the ROUTER, who is calling,
the batch size) and sends with :func:`send_all`; a batch a handler answers
later (a :class:`~remote_g2.rpc.dispatch.Deferred`) is waited on beside the
socket by the threaded modes, settled at once by the driven one.

A mode's life, driven by the server (:class:`ServingMode`): ``bind(ctx)``
inside the server's bind (may raise ``zmq.ZMQError``; ``abort()`` then
closes what it made), ``start(front, spawn)``, and at close ``wake()`` (every
serving thread sees the stop at once), the server joins the threads, then
``release(threads_done)``. The thread that serves a socket closes it.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import zmq

from remote_g2.protocol.messages import MessageSpec
from remote_g2.rpc.connection_identity import ZmqConnectionIdentities
from remote_g2.rpc.dispatch import CallContext, Deferred, Dispatcher, Reply, Request

__all__ = ["ServingMode", "DirectServing", "PooledServing", "DrivenServing", "RouterFront", "send_all"]

log = logging.getLogger("remote_g2.rpc")

_pool_ids = itertools.count()

#: ``spawn(target, thread_name, *args)``: the server's, so that it can join every thread it started.
Spawn = Callable[..., None]
#: A batch a handler answered later: ``(deferred, spec, calls)`` (see :meth:`Dispatcher.dispatch`).
_Waiting = tuple[Deferred, MessageSpec, list[tuple[Any, CallContext]]]


class RouterFront:
    """The server's bound ROUTER socket, read a batch at a time, each request with its caller's identity."""

    def __init__(self, sock: zmq.Socket, identities: ZmqConnectionIdentities | None, max_batch: int) -> None:
        self.sock = sock
        #: the server-drawn identities of the clients' connections (``identify_clients``), else None
        self.identities = identities
        self.max_batch = max_batch

    def read(self, *, block: bool) -> list[Request]:
        """Every request queued (up to ``max_batch``; ``block``: wait for the first), identified."""
        sock, identities = self.sock, self.identities
        raw: list[Any] = []
        flags = 0 if block else zmq.NOBLOCK
        while len(raw) < self.max_batch:
            try:
                if identities is None:
                    raw.append(sock.recv_multipart(flags))
                else:  # only the routing-id frame as a zmq.Frame: its descriptor is all identify() reads
                    frames = [sock.recv(flags, copy=False)]
                    while sock.rcvmore:
                        frames.append(sock.recv())
                    raw.append(frames)
            except zmq.Again:
                break
            flags = zmq.NOBLOCK
        if identities is None:
            return [(None, frames) for frames in raw]
        return [(identity, [frames[0].bytes, *frames[1:]])
                for identity, frames in zip(identities.identify(raw), raw)]

    def close(self) -> None:
        """Stop drawing identities and close the socket (by the thread that served it last)."""
        if self.identities is not None:
            self.identities.close()
        self.sock.close(0)


def send_all(sock: zmq.Socket, replies: list[Reply], name: str) -> None:
    """Send each ``(peer, frame)`` without blocking; a reply that cannot go is dropped (its caller times out)."""
    for peer, reply in replies:
        try:
            sock.send_multipart([peer, reply], zmq.NOBLOCK)
        except zmq.Again:
            log.warning("%s: dropped a reply (the reply queue is full)", name)
        except zmq.ZMQError as e:  # direct mode: the client's connection is gone
            log.debug("%s: reply not sent: %s", name, e)


class ServingMode(ABC):
    """One way of serving the ROUTER; the server calls these in the order of the module docstring."""

    #: How the server's "serving on" log line names the mode.
    describe = ""

    def __init__(self, calls: Dispatcher) -> None:
        self.calls = calls

    def bind(self, ctx: zmq.Context) -> None:
        """Make and bind the mode's own sockets, after the ROUTER is bound (none by default)."""

    def abort(self) -> None:
        """Close what :meth:`bind` made, after a failed bind."""

    @abstractmethod
    def start(self, front: RouterFront, spawn: Spawn) -> None: ...

    def wake(self) -> None:
        """Closing: make every serving thread see the stop now (no thread sleeps on a tick)."""

    def release(self, threads_done: bool) -> None:
        """Closing, after the threads were joined (``threads_done``: all of them ended)."""


class DrivenServing(ServingMode):
    """``workers=0``: no thread; the owner's loop polls :attr:`socket` and calls :meth:`serve_ready`."""

    describe = "driven by its owner's loop"

    def __init__(self, calls: Dispatcher) -> None:
        super().__init__(calls)
        self._front: RouterFront | None = None

    def start(self, front: RouterFront, spawn: Spawn) -> None:
        self._front = front

    @property
    def socket(self) -> zmq.Socket:
        assert self._front is not None
        return self._front.sock

    def serve_ready(self) -> int:
        """Answer every request already queued, on the caller's thread; how many there were.

        Batch handlers that answer with a :class:`~remote_g2.rpc.dispatch.Deferred`
        are settled before this returns (a driven server is meant for quick handlers).
        """
        front = self._front
        assert front is not None
        total = 0
        while True:
            batch = front.read(block=False)
            if not batch:
                return total
            total += len(batch)
            replies, deferred = self.calls.dispatch(batch)
            for d in deferred:
                replies.extend(self.calls.settle(*d))
            send_all(front.sock, replies, self.calls.name)

    def release(self, threads_done: bool) -> None:
        if self._front is not None:  # the owner's loop has stopped using it (the server's contract)
            self._front.close()


class _ThreadedServing(ServingMode):
    """What the direct and pooled modes share: the serving loop of a thread, and the waker that ends it."""

    def __init__(self, calls: Dispatcher, stopping: threading.Event) -> None:
        super().__init__(calls)
        self._stopping = stopping
        # wake() writes a byte here: every serving thread's poll returns at once (they sleep with no tick, whose
        # every wake would take a core from an engine busy on all of them).
        self._waker: tuple[int, int] | None = None

    def _open_waker(self) -> None:
        self._waker = os.pipe()
        os.set_blocking(self._waker[1], False)

    def _serve(self, sock: zmq.Socket, read: Callable[[], list[Request]], close: Callable[[], None]) -> None:
        """Answer requests from ``sock`` (each batch from ``read``) until the stop; then ``close``."""
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        assert self._waker is not None
        poller.register(self._waker[0], zmq.POLLIN)  # (wake() writes to it; nobody reads it)
        calls, name = self.calls, self.calls.name
        waiting: dict[int, _Waiting] = {}
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(1000))  # (the waker ends it at close(); the timeout is a guard)
                if sock in ready:
                    # Everything already queued, in one go.
                    replies, deferred = calls.dispatch(read())
                    send_all(sock, replies, name)
                    for d in deferred:
                        fd = d[0].fileno()
                        if fd < 0 or fd in waiting:  # no socket to wait on: read it now
                            send_all(sock, calls.settle(*d), name)
                        else:
                            waiting[fd] = d
                            poller.register(fd, zmq.POLLIN)
                for fd in [fd for fd in ready if isinstance(fd, int) and fd in waiting]:
                    poller.unregister(fd)
                    send_all(sock, calls.settle(*waiting.pop(fd)), name)
            for d in waiting.values():  # closing: answer what is still on the wire
                send_all(sock, calls.settle(*d), name)
        finally:
            close()

    def wake(self) -> None:
        if self._waker is not None:
            try:
                os.write(self._waker[1], b"x")
            except OSError:  # (full: a wake is pending anyway)
                pass

    def release(self, threads_done: bool) -> None:
        if self._waker is not None and threads_done:
            for fd in self._waker:
                os.close(fd)
            self._waker = None


class DirectServing(_ThreadedServing):
    """``workers=1``: one thread owns the ROUTER and answers each batch itself."""

    describe = "direct"

    def start(self, front: RouterFront, spawn: Spawn) -> None:
        self._open_waker()
        spawn(self._serve, f"{self.calls.name}-rpc", front.sock, lambda: front.read(block=True), front.close)


class PooledServing(_ThreadedServing):
    """``workers=N>1``: a proxy thread between the ROUTER and N handler threads (DEALER sockets over inproc)."""

    def __init__(self, calls: Dispatcher, stopping: threading.Event, workers: int, queue_depth: int,
                 max_batch: int) -> None:
        super().__init__(calls, stopping)
        self._workers = workers
        self.describe = f"{workers} handler threads"
        self._queue_depth = queue_depth
        self._max_batch = max_batch
        tag = f"{id(self):x}-{next(_pool_ids)}"
        self._backend_addr = f"inproc://remote-g2-rpc-{tag}"
        self._control_addr = f"inproc://remote-g2-rpc-ctl-{tag}"
        self._ctx: zmq.Context | None = None
        self._back: zmq.Socket | None = None        # the proxy's end towards the handler threads
        self._control_in: zmq.Socket | None = None  # the proxy's end of the control pair
        self._control: zmq.Socket | None = None     # the server's end: wake() sends TERMINATE on it
        self._identify = False

    def bind(self, ctx: zmq.Context) -> None:
        self._ctx = ctx
        self._back = back = ctx.socket(zmq.DEALER)
        self._control_in = control_in = ctx.socket(zmq.PAIR)
        back.linger = 0
        back.sndhwm = back.rcvhwm = self._queue_depth
        back.bind(self._backend_addr)
        control_in.bind(self._control_addr)
        self._control = ctx.socket(zmq.PAIR)
        self._control.connect(self._control_addr)

    def abort(self) -> None:
        for sock in (self._back, self._control_in):
            if sock is not None:
                sock.close(0)

    def start(self, front: RouterFront, spawn: Spawn) -> None:
        self._identify = front.identities is not None
        self._open_waker()
        for i in range(self._workers):
            spawn(self._handler_thread, f"{self.calls.name}-rpc-{i}")
        spawn(self._run_proxy, f"{self.calls.name}-rpc-proxy", front)

    def wake(self) -> None:
        super().wake()
        if self._control is not None:
            self._control.send(b"TERMINATE")

    def release(self, threads_done: bool) -> None:
        super().release(threads_done)
        if self._control is not None:
            self._control.close(0)

    def _handler_thread(self) -> None:
        assert self._ctx is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvhwm = sock.sndhwm = self._queue_depth
        sock.connect(self._backend_addr)
        self._serve(sock, lambda: self._read_backend(sock), lambda: sock.close(0))

    def _read_backend(self, sock: zmq.Socket) -> list[Request]:
        """A handler thread's batch from the proxy (``[peer, identity, frame…]`` when identifying)."""
        batch: list[Request] = []
        while len(batch) < self._max_batch:
            try:
                frames = sock.recv_multipart(0 if not batch else zmq.NOBLOCK)
            except zmq.Again:
                break
            if self._identify:
                batch.append((frames[1], [frames[0], *frames[2:]]))
            else:
                batch.append((None, frames))
        return batch

    def _run_proxy(self, front: RouterFront) -> None:
        back, control = self._back, self._control_in
        assert back is not None and control is not None
        try:
            if front.identities is None:
                zmq.proxy_steerable(front.sock, back, None, control)  # in C, GIL released, until TERMINATE
            else:
                self._run_identifying_proxy(front, back, control)
        except zmq.ZMQError as e:
            if not self._stopping.is_set():
                log.error("%s: proxy failed: %s", self.calls.name, e)
        finally:
            front.close()
            back.close(0)
            control.close(0)

    def _run_identifying_proxy(self, front: RouterFront, back: zmq.Socket, control: zmq.Socket) -> None:
        """The proxy when the server identifies clients: requests go on as ``[peer, identity, frame…]``."""
        poller = zmq.Poller()
        for sock in (front.sock, back, control):
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if control in ready:
                return  # TERMINATE
            if front.sock in ready:
                for identity, frames in front.read(block=False):
                    back.send_multipart([frames[0], identity or b"", *frames[1:]])
            if back in ready:
                replies: list[Reply] = []
                while True:
                    try:
                        peer, reply = back.recv_multipart(zmq.NOBLOCK)  # a handler thread's [peer, reply]
                    except zmq.Again:
                        break
                    replies.append((peer, reply))
                send_all(front.sock, replies, self.calls.name)
