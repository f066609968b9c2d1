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
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import zmq

import remote_g2
from remote_g2.rpc.connection_identity import ZmqConnectionIdentities
from remote_g2.rpc.curve import CurveServerConfig
from remote_g2.errors import ConfigError, ProtocolError, RemoteG2Error, RpcClosed
from remote_g2.log import RateLimitedLog
from remote_g2.protocol.messages import MESSAGES, MessageSpec, Ping, Pong
from remote_g2.protocol.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    decode_request,
    encode_err,
    encode_ok,
    peek_type,
)

__all__ = ["RpcServer", "CallContext", "Handler", "BatchHandler", "Deferred", "Arrival", "ArrivalHook",
           "normalize_bind_endpoint", "free_port_on_host_of"]

log = logging.getLogger("remote_g2.rpc")

_server_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call besides the request body."""

    peer: bytes          # where the reply goes: the ZMQ routing id (client-chosen!) or the lane's connection id
    msg_id: int          # the request's header id
    type: str            # message name
    received_at: float   # time.perf_counter() when the frame was read
    arrival: Any = None  # what the type's arrival hook returned for this request, if it has one
    identity: bytes | None = None  # the connection's server-drawn identity (``identify_clients``), else None


Handler = Callable[[Any, CallContext], Any]


class Arrival(Protocol):
    """Work an arrival hook started for a request; dropped with :meth:`abandon` if its handler never runs."""

    def abandon(self) -> None: ...


#: ``hook(identity, frame) -> Arrival | None``, registered per message type: called on the serving thread with
#: the raw frame of a request of that type *before* it is decoded (the type is read from the envelope
#: alone), so that work which needs only the frame starts at once. The handler finds the result in
#: ``ctx.arrival``; if the request is refused before its handler runs, the server calls ``abandon()``.
#: A hook must not raise (one that does is logged, and the request served as if it had none).
ArrivalHook = Callable[["bytes | None", bytes], "Arrival | None"]


class Deferred(Protocol):
    """Answers still on their way from a backend: ``fileno()`` turns readable when they arrive."""

    def fileno(self) -> int: ...

    def result(self) -> list[Any]: ...


#: ``batch_handler([(request, ctx), ...]) -> [reply, ...]`` (same order), or a :class:`Deferred`
#: of that list; raising (now, or from ``result()``) answers every call ERR.
BatchHandler = Callable[[list[tuple[Any, CallContext]]], "list[Any] | Deferred"]
#: ``on_call(message_type, seconds, outcome)``; outcome is ``ok``, ``error`` or ``bad_request``.
CallObserver = Callable[[str, float, str], None]


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
        batch_handlers = dict(batch_handlers or {})
        on_arrival = dict(on_arrival or {})
        if set(on_arrival) - set(handlers):
            raise ConfigError(f"arrival hooks for types without a handler: {sorted(set(on_arrival) - set(handlers))}")
        unknown = (set(handlers) | set(batch_handlers)) - set(MESSAGES)
        if unknown:
            raise ConfigError(f"handlers for unknown message types: {sorted(unknown)}")
        one_way = sorted(n for n in (*handlers, *batch_handlers) if MESSAGES[n].reply is None)
        if one_way:
            raise ConfigError(f"{one_way} are one-way messages of the local links, not RPCs")
        if set(handlers) & set(batch_handlers):
            raise ConfigError(f"both a handler and a batch handler for {sorted(set(handlers) & set(batch_handlers))}")
        if workers < 0 or queue_depth < 1 or max_batch < 1:
            raise ConfigError("workers must be >= 0, queue_depth and max_batch >= 1")
        self._endpoint = normalize_bind_endpoint(endpoint)
        self._handlers: dict[str, Handler] = {"ping": self._ping, **handlers}
        self._batch_handlers = batch_handlers
        self._on_arrival = on_arrival
        self._max_batch = max_batch
        self.name = name
        self._workers = workers
        self._queue_depth = queue_depth
        self._max_frame = max_frame_bytes
        self._curve = curve
        self._on_call = on_call
        self._identify = identify_clients
        self._hostile = RateLimitedLog(log)
        self._identities: ZmqConnectionIdentities | None = None
        # ZAP is per context, so a server that runs it gets a private context: with an allow-list (it admits
        # only those keys), and when it identifies clients under CURVE (a ZAP that admits any key tells the
        # server each connection's key, which becomes part of the connection's identity).
        self._zap = curve is not None and (curve.allowed_clients_dir is not None or identify_clients)
        self._own_context = context is None and self._zap
        self._ctx = zmq.Context() if self._own_context else (context or zmq.Context.instance())
        tag = f"{id(self):x}-{next(_server_ids)}"
        self._backend_addr = f"inproc://remote-g2-rpc-{tag}"
        self._control_addr = f"inproc://remote-g2-rpc-ctl-{tag}"
        self._auth: Any = None
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        # close() writes a byte here: every handler thread's poll returns at once (they sleep with no tick, whose
        # every wake would take a core from an engine busy on all of them).
        self._waker: tuple[int, int] | None = None
        self._control: zmq.Socket | None = None
        self._closed = False
        self._driven: zmq.Socket | None = None
        self._bound: str | None = None
        self._t0 = time.monotonic()

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
        if self._threads or self._driven is not None:
            raise ConfigError("server already started")
        direct = self._workers <= 1
        front = self._ctx.socket(zmq.ROUTER)
        back = None if direct else self._ctx.socket(zmq.DEALER)
        control_in = None if direct else self._ctx.socket(zmq.PAIR)
        sockets = [x for x in (front, back, control_in) if x is not None]
        try:
            for sock in (front, back):
                if sock is not None:
                    sock.linger = 0
                    sock.sndhwm = sock.rcvhwm = self._queue_depth
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
                self._identities = ZmqConnectionIdentities(front)
            front.bind(self._endpoint)
            if back is not None and control_in is not None:
                back.bind(self._backend_addr)
                control_in.bind(self._control_addr)
                self._control = self._ctx.socket(zmq.PAIR)
                self._control.connect(self._control_addr)
        except zmq.ZMQError as e:
            if self._identities is not None:
                self._identities.close()
            for sock in sockets:
                sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            raise ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}") from None
        self._bound = front.getsockopt_string(zmq.LAST_ENDPOINT)
        if self._workers == 0:
            self._driven = front
            log.info("%s serving on %s (driven by its owner's loop)", self.name, self._bound)
            return self._bound
        self._waker = os.pipe()
        os.set_blocking(self._waker[1], False)
        if direct:
            self._spawn(self._serve_requests, f"{self.name}-rpc", front)
        else:
            for i in range(self._workers):
                self._spawn(self._serve_requests, f"{self.name}-rpc-{i}", None)
            self._spawn(self._run_proxy, f"{self.name}-rpc-proxy", front, back, control_in)
        log.info("%s serving on %s (%s)", self.name, self._bound,
                 "direct" if direct else f"{self._workers} handler threads")
        return self._bound

    @property
    def socket(self) -> zmq.Socket:
        """Driven mode: the ROUTER socket the owner polls for ``POLLIN`` (valid after :meth:`start`)."""
        if self._driven is None:
            raise ConfigError(f"{self.name}: only a driven server (workers=0) exposes its socket")
        return self._driven

    def serve_ready(self) -> int:
        """Driven mode, on the owner's thread: answer every request already queued; how many there were.

        Batch handlers that answer with a :class:`Deferred` are settled before
        this returns (a driven server is meant for quick handlers).
        """
        sock = self.socket
        total = 0
        while True:
            batch = self._read_front(sock, block=False)
            if not batch:
                return total
            total += len(batch)
            replies, deferred = self._dispatch(batch)
            for d in deferred:
                replies.extend(self._settle(*d))
            self._send_all(sock, replies)

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
        if self._waker is not None:
            try:
                os.write(self._waker[1], b"x")
            except OSError:  # (full: a wake is pending anyway)
                pass
        if self._control is not None:
            self._control.send(b"TERMINATE")
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._waker is not None and not any(t.is_alive() for t in self._threads):
            for fd in self._waker:
                os.close(fd)
            self._waker = None
        if self._control is not None:
            self._control.close(0)
        if self._driven is not None:  # the owner's loop has stopped using it (see serve_ready)
            if self._identities is not None:
                self._identities.close()
            self._driven.close(0)
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

    # -- threads -----------------------------------------------------------------

    def _run_proxy(self, front: zmq.Socket, back: zmq.Socket, control: zmq.Socket) -> None:
        try:
            if self._identities is None:
                zmq.proxy_steerable(front, back, None, control)  # in C, GIL released, until TERMINATE
            else:
                self._run_identifying_proxy(front, back, control)
        except zmq.ZMQError as e:
            if not self._stopping.is_set():
                log.error("%s: proxy failed: %s", self.name, e)
        finally:
            if self._identities is not None:
                self._identities.close()
            for sock in (front, back, control):
                sock.close(0)

    def _run_identifying_proxy(self, front: zmq.Socket, back: zmq.Socket, control: zmq.Socket) -> None:
        """The proxy of a pooled server that identifies clients: requests go on as ``[peer, identity, frame…]``."""
        poller = zmq.Poller()
        for sock in (front, back, control):
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll())
            if control in ready:
                return  # TERMINATE
            if front in ready:
                for identity, frames in self._read_front(front, block=False):
                    back.send_multipart([frames[0], identity or b"", *frames[1:]])
            if back in ready:
                replies: list[tuple[bytes, bytes]] = []
                while True:
                    try:
                        peer, reply = back.recv_multipart(zmq.NOBLOCK)  # a handler thread's [peer, reply]
                    except zmq.Again:
                        break
                    replies.append((peer, reply))
                self._send_all(front, replies)

    def _read_front(self, sock: zmq.Socket, *, block: bool) -> list[tuple[bytes | None, list[bytes]]]:
        """Every request queued on the ROUTER (up to ``max_batch``; ``block``: wait for the first), identified."""
        identities = self._identities
        raw: list[Any] = []
        flags = 0 if block else zmq.NOBLOCK
        while len(raw) < self._max_batch:
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

    def _serve_requests(self, own: zmq.Socket | None) -> None:
        """Answer requests from ``own`` (direct mode: the ROUTER itself) or from the proxy."""
        if own is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.rcvhwm = sock.sndhwm = self._queue_depth
            sock.connect(self._backend_addr)
        else:
            sock = own
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        assert self._waker is not None
        poller.register(self._waker[0], zmq.POLLIN)  # (close() writes to it; nobody reads it)
        waiting: dict[int, tuple[Deferred, MessageSpec, list[tuple[Any, CallContext]]]] = {}
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(1000))  # (the waker ends it at close(); the timeout is a guard)
                if sock in ready:
                    # Everything already queued, in one go.
                    batch = self._read_front(sock, block=True) if own is not None else self._read_backend(sock)
                    replies, deferred = self._dispatch(batch)
                    self._send_all(sock, replies)
                    for d in deferred:
                        fd = d[0].fileno()
                        if fd < 0 or fd in waiting:  # no socket to wait on: read it now
                            self._send_all(sock, self._settle(*d))
                        else:
                            waiting[fd] = d
                            poller.register(fd, zmq.POLLIN)
                for fd in [fd for fd in ready if isinstance(fd, int) and fd in waiting]:
                    poller.unregister(fd)
                    self._send_all(sock, self._settle(*waiting.pop(fd)))
            for d in waiting.values():  # closing: answer what is still on the wire
                self._send_all(sock, self._settle(*d))
        finally:
            if own is not None and self._identities is not None:
                self._identities.close()
            sock.close(0)

    def _read_backend(self, sock: zmq.Socket) -> list[tuple[bytes | None, list[bytes]]]:
        """A handler thread's batch from the proxy (``[peer, identity, frame…]`` when identifying)."""
        batch: list[tuple[bytes | None, list[bytes]]] = []
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

    def _send_all(self, sock: zmq.Socket, replies: list[tuple[bytes, bytes]]) -> None:
        for peer, reply in replies:
            try:
                sock.send_multipart([peer, reply], zmq.NOBLOCK)
            except zmq.Again:
                log.warning("%s: dropped a reply (the reply queue is full)", self.name)
            except zmq.ZMQError as e:  # direct mode: the client's connection is gone
                log.debug("%s: reply not sent: %s", self.name, e)

    def _dispatch(self, batch: list[tuple[bytes | None, list[bytes]]]) -> tuple[list[tuple[bytes, bytes]], list[Any]]:
        """Validate and answer a batch of requests: ``(identity, [peer, frame…])`` each.

        Returns ``(peer, reply frame)`` for every request answered now, and
        ``(deferred, spec, calls)`` for every batch a handler answered later.
        """
        out: list[tuple[bytes, bytes]] = []
        later: list[Any] = []
        grouped: dict[str, list[tuple[Any, CallContext]]] = {}
        for identity, frames in batch:
            # Each request's hook runs just before it is decoded and handled, not all of a batch's first: a
            # hook may start calls its handler then waits for, one at a time per thread (source/siblings.py).
            arrival = self._arrive(identity, frames) if self._on_arrival else None
            call = self._decode(frames, arrival, identity)
            if isinstance(call, bytes):
                if arrival is not None:
                    self._abandon(arrival)
                out.append((frames[0], call))
                continue
            spec, request, ctx = call
            if spec.name in self._batch_handlers:
                grouped.setdefault(spec.name, []).append((request, ctx))
            else:
                out.append((ctx.peer, self._invoke(self._handlers[spec.name], spec, request, ctx)))
        for name, calls in grouped.items():
            spec = MESSAGES[name]
            try:
                replies = self._batch_handlers[name](calls)
            except Exception as e:
                out.extend((ctx.peer, self._answer_error(spec, ctx, e)) for _, ctx in calls)
                continue
            if isinstance(replies, list):
                out.extend(self._answer_batch(spec, calls, replies))
            else:
                later.append((replies, spec, calls))
        return out, later

    def _settle(self, deferred: Deferred, spec: MessageSpec,
                calls: list[tuple[Any, CallContext]]) -> list[tuple[bytes, bytes]]:
        try:
            replies = deferred.result()
        except Exception as e:
            return [(ctx.peer, self._answer_error(spec, ctx, e)) for _, ctx in calls]
        return self._answer_batch(spec, calls, replies)

    def _answer_batch(self, spec: MessageSpec, calls: list[tuple[Any, CallContext]],
                      replies: list[Any]) -> list[tuple[bytes, bytes]]:
        if len(replies) != len(calls):
            e = TypeError(f"batch handler for {spec.name} answered {len(replies)} of {len(calls)} calls")
            return [(ctx.peer, self._answer_error(spec, ctx, e)) for _, ctx in calls]
        return [(ctx.peer, self._answer(spec, ctx, reply)) for (_, ctx), reply in zip(calls, replies)]

    def _arrive(self, identity: bytes | None, frames: list[bytes]) -> Any:
        """Run the arrival hook of the request's type, if it has one (before the frame is decoded)."""
        if len(frames) != 2:
            return None
        hook = self._on_arrival.get(peek_type(frames[1], max_frame_bytes=self._max_frame) or "")
        if hook is None:
            return None
        try:
            return hook(identity, frames[1])
        except Exception:  # a bug in the hook: serve the request without it
            log.exception("%s: arrival hook failed", self.name)
            return None

    def _abandon(self, arrival: Any) -> None:
        try:
            arrival.abandon()
        except Exception:
            log.exception("%s: abandoning an arrival failed", self.name)

    def _decode(self, frames: list[bytes], arrival: Any = None,
                identity: bytes | None = None) -> bytes | tuple[MessageSpec, Any, CallContext]:
        """The validated call, or the ERR frame that answers a bad one."""
        t0 = time.perf_counter()
        if len(frames) != 2:
            self._observe("?", t0, "bad_request")
            self.note_malformed(f"{len(frames) - 1} frames in one message")
            return encode_err(next(self._ids), None, "ProtocolError",
                              f"expected one frame per message, got {len(frames) - 1}")
        try:
            frame, spec, request = decode_request(frames[1], max_frame_bytes=self._max_frame)
        except ProtocolError as e:
            self._observe("?", t0, "bad_request")
            self.note_malformed(e.message)
            return encode_err(next(self._ids), e.request_id, type(e).__name__, e.message)  # its id when readable
        if spec.name not in self._handlers and spec.name not in self._batch_handlers:
            self._observe(spec.name, t0, "bad_request")
            self.note_malformed(f"{spec.name!r} is not served here")
            return encode_err(next(self._ids), frame.id, "UnknownMessage", f"{self.name} does not serve {spec.name!r}")
        return spec, request, CallContext(frames[0], frame.id, spec.name, t0, arrival, identity)

    def note_malformed(self, what: str) -> None:
        """Log a refused frame — at most one line a minute per server: clients can send them at will."""
        self._hostile.warning("malformed", "%s: refused a malformed request: %s", self.name, what[:200])

    def _invoke(self, handler: Handler, spec: MessageSpec, request: Any, ctx: CallContext) -> bytes:
        try:
            reply = handler(request, ctx)
        except Exception as e:
            return self._answer_error(spec, ctx, e)
        return self._answer(spec, ctx, reply)

    def _answer(self, spec: MessageSpec, ctx: CallContext, reply: Any) -> bytes:
        if not isinstance(reply, spec.reply):
            return self._answer_error(spec, ctx, TypeError(
                f"handler for {spec.name} returned {type(reply).__name__}, expected {spec.reply.__name__}"))
        try:
            data = encode_ok(next(self._ids), ctx.msg_id, reply)
        except Exception as e:  # a reply the wire cannot carry (e.g. an id a packed list cannot hold)
            return self._answer_error(spec, ctx, e)
        self._observe(spec.name, ctx.received_at, "ok")
        return data

    def _answer_error(self, spec: MessageSpec, ctx: CallContext, e: Exception) -> bytes:
        if isinstance(e, RemoteG2Error):
            data = encode_err(next(self._ids), ctx.msg_id, type(e).__name__, e.message)
        else:
            log.error("%s: handler for %s failed", self.name, spec.name, exc_info=e)
            data = encode_err(next(self._ids), ctx.msg_id, "InternalError", f"{type(e).__name__}: {e}")
        self._observe(spec.name, ctx.received_at, "error")
        return data

    def _observe(self, type_: str, t0: float, outcome: str) -> None:
        if self._on_call is not None:
            try:
                self._on_call(type_, time.perf_counter() - t0, outcome)
            except Exception:  # metrics must never break serving
                log.exception("%s: on_call observer failed", self.name)

    def _ping(self, request: Ping, ctx: CallContext) -> Pong:
        return Pong(server=self.name, version=remote_g2.__version__, uptime_s=time.monotonic() - self._t0)
