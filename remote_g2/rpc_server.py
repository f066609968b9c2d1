"""A ROUTER-socket RPC server that serves many clients at once.

Clients talk to one ROUTER socket. A ZMQ proxy running in C (no GIL) hands
each request to one of ``workers`` handler threads over inproc, and carries
the replies back; every handler thread owns its own socket, reads the frame,
validates it, runs the handler and answers. There is no Python hop between
reading a request and handling it, so a request costs one thread wake-up, and
one slow request holds up only its own thread: no client waits in REQ/REP
lockstep behind another.

Overload is backpressure, not loss: each thread's queue is bounded by the ZMQ
high-water mark (``queue_depth``); past it the proxy stops reading and the
clients' calls time out with :class:`~remote_g2.errors.RpcTimeout` naming the
call.

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
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import zmq

import remote_g2
from remote_g2.curve import CurveServerConfig
from remote_g2.errors import ConfigError, ProtocolError, RemoteG2Error, RpcClosed
from remote_g2.messages import MESSAGES, MessageSpec, Ping, Pong
from remote_g2.wire import (
    DEFAULT_MAX_FRAME_BYTES,
    decode_frame,
    decode_request_body,
    encode_err,
    encode_ok,
)

__all__ = ["RpcServer", "CallContext", "Handler", "normalize_bind_endpoint"]

log = logging.getLogger("remote_g2.rpc")

_server_ids = itertools.count()


@dataclass(frozen=True, slots=True)
class CallContext:
    """What a handler knows about the call besides the request body."""

    peer: bytes          # ZMQ routing id of the client connection
    msg_id: int          # the request's header id
    type: str            # message name
    received_at: float   # time.perf_counter() when the frame was read


Handler = Callable[[Any, CallContext], Any]
#: ``on_call(message_type, seconds, outcome)``; outcome is ``ok``, ``error`` or ``bad_request``.
CallObserver = Callable[[str, float, str], None]


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
    ``workers`` is the number of handler threads (at least 1).
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
    ) -> None:
        unknown = set(handlers) - set(MESSAGES)
        if unknown:
            raise ConfigError(f"handlers for unknown message types: {sorted(unknown)}")
        if workers < 1 or queue_depth < 1:
            raise ConfigError("workers and queue_depth must be >= 1")
        self._endpoint = normalize_bind_endpoint(endpoint)
        self._handlers: dict[str, Handler] = {"ping": self._ping, **handlers}
        self.name = name
        self._workers = workers
        self._queue_depth = queue_depth
        self._max_frame = max_frame_bytes
        self._curve = curve
        self._on_call = on_call
        # ZAP authentication is per context, so an allow-list gets a private context.
        self._own_context = context is None and curve is not None and curve.allowed_clients_dir is not None
        self._ctx = zmq.Context() if self._own_context else (context or zmq.Context.instance())
        tag = f"{id(self):x}-{next(_server_ids)}"
        self._backend_addr = f"inproc://remote-g2-rpc-{tag}"
        self._control_addr = f"inproc://remote-g2-rpc-ctl-{tag}"
        self._auth: Any = None
        self._ids = itertools.count(1)
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._control: zmq.Socket | None = None
        self._closed = False
        self._bound: str | None = None
        self._t0 = time.monotonic()

    # -- lifecycle -----------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """The bound endpoint (valid after :meth:`start`)."""
        if self._bound is None:
            raise RpcClosed("server is not started")
        return self._bound

    def start(self) -> str:
        """Bind and start serving in background threads; return the bound endpoint."""
        if self._threads:
            raise ConfigError("server already started")
        front = self._ctx.socket(zmq.ROUTER)
        back = self._ctx.socket(zmq.DEALER)
        control_in = self._ctx.socket(zmq.PAIR)
        try:
            for sock in (front, back):
                sock.linger = 0
                sock.sndhwm = sock.rcvhwm = self._queue_depth
            # Hard cap well above the protocol limit: frames between the two get a
            # clean ERR; only absurd ones make libzmq drop the connection.
            front.maxmsgsize = 4 * self._max_frame
            if self._curve is not None:
                if self._curve.allowed_clients_dir is not None:
                    from zmq.auth.thread import ThreadAuthenticator

                    self._auth = ThreadAuthenticator(self._ctx)
                    self._auth.start()
                    self._auth.configure_curve(domain="*", location=str(self._curve.allowed_clients_dir))
                self._curve.apply(front)
            front.bind(self._endpoint)
            back.bind(self._backend_addr)
            control_in.bind(self._control_addr)
            self._control = self._ctx.socket(zmq.PAIR)
            self._control.connect(self._control_addr)
        except zmq.ZMQError as e:
            for sock in (front, back, control_in):
                sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            raise ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}") from None
        self._bound = front.getsockopt_string(zmq.LAST_ENDPOINT)
        for i in range(self._workers):
            self._spawn(self._serve_requests, f"{self.name}-rpc-{i}")
        self._spawn(self._run_proxy, f"{self.name}-rpc-proxy", front, back, control_in)
        log.info("%s serving on %s (%d handler threads)", self.name, self._bound, self._workers)
        return self._bound

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
        if self._control is not None:
            self._control.send(b"TERMINATE")
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        if self._control is not None:
            self._control.close(0)
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
            zmq.proxy_steerable(front, back, None, control)  # in C, GIL released, until TERMINATE
        except zmq.ZMQError as e:
            if not self._stopping.is_set():
                log.error("%s: proxy failed: %s", self.name, e)
        finally:
            for sock in (front, back, control):
                sock.close(0)

    def _serve_requests(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.linger = 0
        sock.rcvhwm = sock.sndhwm = self._queue_depth
        sock.connect(self._backend_addr)
        try:
            while not self._stopping.is_set():
                # The timeout only bounds how long close() waits for this thread.
                if not sock.poll(100, zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                reply = self._dispatch(frames)
                try:
                    sock.send_multipart([frames[0], reply], zmq.NOBLOCK)
                except zmq.Again:
                    log.warning("%s: dropped a reply (the reply queue is full)", self.name)
        finally:
            sock.close(0)

    def _dispatch(self, frames: list[bytes]) -> bytes:
        """Validate one request and run its handler; always returns the reply frame."""
        t0 = time.perf_counter()
        if len(frames) != 2:
            self._observe("?", t0, "bad_request")
            return encode_err(next(self._ids), None, "ProtocolError",
                              f"expected one frame per message, got {len(frames) - 1}")
        frame = None
        try:
            frame = decode_frame(frames[1], max_frame_bytes=self._max_frame)
            if frame.re is not None:
                raise ProtocolError("a request must not carry header.re")
            spec, request = decode_request_body(frame)
        except ProtocolError as e:
            self._observe("?", t0, "bad_request")
            re = frame.id if frame is not None else e.request_id  # name the request when we can
            return encode_err(next(self._ids), re, type(e).__name__, e.message)
        handler = self._handlers.get(spec.name)
        if handler is None:
            self._observe(spec.name, t0, "bad_request")
            return encode_err(next(self._ids), frame.id, "UnknownMessage", f"{self.name} does not serve {spec.name!r}")
        return self._invoke(handler, spec, request, CallContext(frames[0], frame.id, spec.name, t0))

    def _invoke(self, handler: Handler, spec: MessageSpec, request: Any, ctx: CallContext) -> bytes:
        outcome = "ok"
        try:
            reply = handler(request, ctx)
            if not isinstance(reply, spec.reply):
                raise TypeError(f"handler for {spec.name} returned {type(reply).__name__}, "
                                f"expected {spec.reply.__name__}")
            data = encode_ok(next(self._ids), ctx.msg_id, reply)
        except RemoteG2Error as e:
            outcome = "error"
            data = encode_err(next(self._ids), ctx.msg_id, type(e).__name__, e.message)
        except Exception as e:
            outcome = "error"
            log.exception("%s: handler for %s failed", self.name, spec.name)
            data = encode_err(next(self._ids), ctx.msg_id, "InternalError", f"{type(e).__name__}: {e}")
        self._observe(spec.name, ctx.received_at, outcome)
        return data

    def _observe(self, type_: str, t0: float, outcome: str) -> None:
        if self._on_call is not None:
            try:
                self._on_call(type_, time.perf_counter() - t0, outcome)
            except Exception:  # metrics must never break serving
                log.exception("%s: on_call observer failed", self.name)

    def _ping(self, request: Ping, ctx: CallContext) -> Pong:
        return Pong(server=self.name, version=remote_g2.__version__, uptime_s=time.monotonic() - self._t0)
