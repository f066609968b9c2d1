"""A ROUTER-socket RPC server that serves many clients at once.

Three ways to serve, chosen by ``workers``:

* ``workers=1`` (direct): one thread owns the ROUTER socket, reads a request,
  handles it and answers. Nothing sits between the socket and the handler, so
  a request costs no thread hand-off: the lowest latency, and the right choice
  when handlers mostly wait on one backend that serialises work anyway (a
  single Redis runs one script at a time).
* ``workers=N>1`` (pooled): a ZMQ proxy running in C (no GIL) hands each
  request to one of N handler threads over inproc and carries the replies
  back. One slow request holds up only its own thread; each request pays one
  extra thread wake-up for it (docs/benchmarks.md, "One-off measurements").

* ``workers=0`` (driven): no thread at all. The owner's own event loop polls
  :attr:`RpcServer.socket` and calls :meth:`RpcServer.serve_ready`; handlers
  run on the owner's thread, so a request reaches the code that acts on it
  with no hand-off (the target's per-rank loops serve their IPC this way).

Either way no client waits in REQ/REP lockstep behind another: replies go back
by routing id, in any order.

Who is calling: with ``identify_clients=True`` every call's
``ctx.identity`` is the identity the server drew for the client's connection
(:mod:`remote_g2.rpc.connection_identity`) — what leases are bound to. The
routing id (``ctx.peer``) only addresses the reply: a client chooses it. In
pooled mode this puts a Python thread in place of the C proxy (identities
must be drawn in the order the socket delivered the messages), one more
hand-off per request; servers that own nothing per client leave it off.

Batching: a serving thread takes every request already queued (up to
``max_batch``) in one go. Requests of a type with a *batch handler* are handed
over together, so a store can answer them with one backend round trip (the
registry pipelines lookups to Redis); a lone request is a batch of one. A
batch handler may also answer with a :class:`Deferred` — the batch is on the
wire to its backend — and the thread goes on reading and sending more while
the backend works, then answers the batch when its socket turns readable.
Under load this is where throughput comes from; at low load it costs nothing.

Overload is backpressure, not loss: queues are bounded by the ZMQ high-water
mark (``queue_depth``); past it the server stops reading and the clients'
calls time out with :class:`~remote_g2.errors.RpcTimeout` naming the call.

Contract for handlers: ``handler(request, ctx) -> reply`` where ``request`` is
the validated request dataclass and ``reply`` an instance of the message's
reply class. Handlers may run concurrently on different threads. Raising a
:class:`~remote_g2.errors.RemoteG2Error` answers ``ERR`` with that class's
name; any other exception answers ``ERR InternalError`` and is logged with its
traceback. A malformed, oversized or unknown frame answers ``ERR`` and the
server keeps serving.

Parts: this module binds the socket (CURVE, ZAP, client identities) and owns
the server's life; each serving mode is an object in :mod:`remote_g2.rpc.serving`
(:class:`~remote_g2.rpc.serving.DirectServing`, ``PooledServing``,
``DrivenServing``); frames become handler calls and replies in
:class:`~remote_g2.rpc.dispatch.Dispatcher`, where the handler contract's types
(:class:`CallContext`, :data:`Handler`, :class:`Deferred`, ...) live and from
where this module re-exports them.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import zmq

from remote_g2.errors import ConfigError, RpcClosed
from remote_g2.protocol.wire import DEFAULT_MAX_FRAME_BYTES
from remote_g2.rpc.connection_identity import ZmqConnectionIdentities
from remote_g2.rpc.curve import CurveServerConfig
from remote_g2.rpc.dispatch import (
    Arrival, ArrivalHook, BatchHandler, CallContext, CallObserver, Deferred, Dispatcher, Handler, Reply, Request,
)
from remote_g2.rpc.serving import DirectServing, DrivenServing, PooledServing, RouterFront, ServingMode

__all__ = ["RpcServer", "CallContext", "Handler", "BatchHandler", "Deferred", "Arrival", "ArrivalHook",
           "normalize_bind_endpoint", "free_port_on_host_of"]

log = logging.getLogger("remote_g2.rpc")


def free_port_on_host_of(endpoint: str) -> str:
    """``tcp://HOST:0`` for the host of the TCP endpoint ``endpoint``: another server beside it, any free port."""
    if not endpoint.startswith("tcp://"):
        raise ConfigError(f"{endpoint!r} is not a tcp:// endpoint")
    return f"tcp://{endpoint[len('tcp://'):].rsplit(':', 1)[0]}:0"


def normalize_bind_endpoint(endpoint: str) -> str:
    """Accept ``tcp://HOST:0`` for "any free port" (ZMQ itself spells it ``*``)."""
    if endpoint.startswith("tcp://") and endpoint.endswith(":0"):
        return endpoint[:-2] + ":*"
    return endpoint


class RpcServer:
    """Serve the handlers in ``handlers`` (message name → handler) on ``endpoint``.

    ``start()`` binds and returns the bound endpoint (with the real port when
    ``:0`` was asked); ``close()`` stops the proxy and the handler threads and
    closes the sockets. ``ping`` is answered by every server unless overridden.
    ``workers`` is the number of handler threads (0: driven by the owner; see
    the module docstring). A driven server is closed after its owner's loop
    stopped using the socket.
    """

    def __init__(
        self,
        endpoint: str,
        handlers: Mapping[str, Handler],
        *,
        name: str = "remote-g2",
        workers: int = 4,
        queue_depth: int = 1000,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        curve: CurveServerConfig | None = None,
        context: zmq.Context | None = None,
        on_call: CallObserver | None = None,
        batch_handlers: Mapping[str, BatchHandler] | None = None,
        max_batch: int = 64,
        on_arrival: Mapping[str, ArrivalHook] | None = None,
        identify_clients: bool = False,
    ) -> None:
        self._calls = Dispatcher(name, handlers, batch_handlers=batch_handlers, on_arrival=on_arrival,
                                 max_frame_bytes=max_frame_bytes, on_call=on_call)
        if workers < 0 or queue_depth < 1 or max_batch < 1:
            raise ConfigError("workers must be >= 0, queue_depth and max_batch >= 1")
        self._endpoint = normalize_bind_endpoint(endpoint)
        self._max_batch = max_batch
        self.name = name
        self._workers = workers
        self._queue_depth = queue_depth
        self._max_frame = max_frame_bytes
        self._curve = curve
        self._identify = identify_clients
        # ZAP is per context, so a server that runs it gets a private context: with an allow-list (it admits
        # only those keys), and when it identifies clients under CURVE (a ZAP that admits any key tells the
        # server each connection's key, which becomes part of the connection's identity).
        self._zap = curve is not None and (curve.allowed_clients_dir is not None or identify_clients)
        self._own_context = context is None and self._zap
        self._ctx = zmq.Context() if self._own_context else (context or zmq.Context.instance())
        self._auth: Any = None
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._mode: ServingMode | None = None  # set by a successful start()
        self._closed = False
        self._bound: str | None = None

    # -- lifecycle -----------------------------------------------------------

    @property
    def context(self) -> zmq.Context:
        """The ZMQ context the server's sockets live in (its own when CURVE has an allow-list: ZAP is per context)."""
        return self._ctx

    @property
    def endpoint(self) -> str:
        """The bound endpoint (valid after :meth:`start`)."""
        if self._bound is None:
            raise RpcClosed("server is not started")
        return self._bound

    def start(self) -> str:
        """Bind and start serving in background threads; return the bound endpoint."""
        if self._mode is not None:
            raise ConfigError("server already started")
        mode = self._new_mode()
        front = self._ctx.socket(zmq.ROUTER)
        identities: ZmqConnectionIdentities | None = None
        try:
            front.linger = 0
            front.sndhwm = front.rcvhwm = self._queue_depth
            # Hard cap well above the protocol limit: frames between the two get a
            # clean ERR; only absurd ones make libzmq drop the connection.
            front.maxmsgsize = 4 * self._max_frame
            if self._curve is not None:
                if self._zap:
                    from zmq.auth import CURVE_ALLOW_ANY
                    from zmq.auth.thread import ThreadAuthenticator

                    allowed = self._curve.allowed_clients_dir
                    self._auth = ThreadAuthenticator(self._ctx)
                    self._auth.start()
                    self._auth.configure_curve(domain="*", location=CURVE_ALLOW_ANY if allowed is None
                                               else str(allowed))
                self._curve.apply(front)
            if self._identify:  # before bind: every accept is reported
                identities = ZmqConnectionIdentities(front)
            front.bind(self._endpoint)
            mode.bind(self._ctx)
        except zmq.ZMQError as e:
            if identities is not None:
                identities.close()
            front.close(0)
            mode.abort()
            if self._auth is not None:
                self._auth.stop()
            raise ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}") from None
        self._bound = front.getsockopt_string(zmq.LAST_ENDPOINT)
        mode.start(RouterFront(front, identities, self._max_batch), self._spawn)
        self._mode = mode
        log.info("%s serving on %s (%s)", self.name, self._bound, mode.describe)
        return self._bound

    def _new_mode(self) -> ServingMode:
        if self._workers == 0:
            return DrivenServing(self._calls)
        if self._workers == 1:
            return DirectServing(self._calls, self._stopping)
        return PooledServing(self._calls, self._stopping, self._workers, self._queue_depth, self._max_batch)

    def _driven(self) -> DrivenServing:
        if not isinstance(self._mode, DrivenServing):
            raise ConfigError(f"{self.name}: only a driven server (workers=0) exposes its socket")
        return self._mode

    @property
    def socket(self) -> zmq.Socket:
        """Driven mode: the ROUTER socket the owner polls for ``POLLIN`` (valid after :meth:`start`)."""
        return self._driven().socket

    def serve_ready(self) -> int:
        """Driven mode, on the owner's thread: answer every request already queued; how many there were.

        Batch handlers that answer with a :class:`Deferred` are settled before
        this returns (a driven server is meant for quick handlers).
        """
        return self._driven().serve_ready()

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Start (if needed) and block until ``stop`` is set or :meth:`close` is called."""
        if not self._threads:
            self.start()
        while not self._stopping.is_set():
            if stop is not None and stop.wait(0.2):
                break
            self._stopping.wait(0.2)
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving; idempotent. Requests still queued are dropped (their callers time out)."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        if self._mode is not None:
            self._mode.wake()
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._mode is not None:
            self._mode.release(threads_done=not any(t.is_alive() for t in self._threads))
        if self._auth is not None:
            self._auth.stop()
        if self._own_context:
            self._ctx.term()
        log.info("%s stopped", self.name)

    def __enter__(self) -> RpcServer:
        if not self._threads:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- for a transport built on this server (the stream lane's StreamRpcServer): the same calls ------------

    def note_malformed(self, what: str) -> None:
        """Log a refused frame — at most one line a minute per server: clients can send them at will."""
        self._calls.note_malformed(what)

    def _dispatch(self, batch: list[Request]) -> tuple[list[Reply], list[Any]]:
        return self._calls.dispatch(batch)

    def _settle(self, deferred: Deferred, spec: Any, calls: list[tuple[Any, CallContext]]) -> list[Reply]:
        return self._calls.settle(deferred, spec, calls)

    def _observe(self, type_: str, t0: float, outcome: str) -> None:
        self._calls.observe(type_, t0, outcome)

    @property
    def _ids(self) -> Any:
        """The header ids of the frames this server sends (an ``itertools.count``)."""
        return self._calls.ids
