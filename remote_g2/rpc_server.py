"""A ROUTER-socket RPC server that serves many clients at once.

One I/O thread owns the ROUTER socket: it reads frames, validates them, and
either answers in place (cheap handlers, listed in ``inline``) or hands the
request to a thread pool. Workers never touch the ROUTER socket (ZMQ sockets
are single-threaded); they push finished replies to the I/O thread over an
inproc PUSH/PULL pair. So one slow request never blocks another client, and
no client waits in REQ/REP lockstep behind someone else's call.

Contract for handlers: ``handler(request, ctx) -> reply`` where ``request`` is
the validated request dataclass and ``reply`` an instance of the message's
reply class. Raising a :class:`~remote_g2.errors.RemoteG2Error` answers
``ERR`` with that class's name; any other exception answers
``ERR InternalError`` and is logged with its traceback. A malformed,
oversized or unknown frame answers ``ERR`` and the server keeps serving.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Collection, Mapping
from concurrent.futures import ThreadPoolExecutor
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
_STOP = b"\x00stop"


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
    ``:0`` was asked); ``close()`` stops the loop, drops queued work and closes
    the sockets. ``ping`` is answered by every server unless overridden.
    """

    def __init__(
        self,
        endpoint: str,
        handlers: Mapping[str, Handler],
        *,
        name: str = "remote-g2",
        workers: int = 4,
        inline: Collection[str] = ("ping",),
        max_pending: int = 1024,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        curve: CurveServerConfig | None = None,
        context: zmq.Context | None = None,
        on_call: CallObserver | None = None,
    ) -> None:
        unknown = set(handlers) - set(MESSAGES)
        if unknown:
            raise ConfigError(f"handlers for unknown message types: {sorted(unknown)}")
        if workers < 0 or max_pending < 1:
            raise ConfigError("workers must be >= 0 and max_pending >= 1")
        self._endpoint = normalize_bind_endpoint(endpoint)
        self._handlers: dict[str, Handler] = {"ping": self._ping, **handlers}
        self._inline = frozenset(inline) if workers else frozenset(self._handlers)
        self.name = name
        self._workers = workers
        self._max_pending = max_pending
        self._max_frame = max_frame_bytes
        self._curve = curve
        self._on_call = on_call
        # ZAP authentication is per context, so an allow-list gets a private context.
        self._own_context = context is None and curve is not None and curve.allowed_clients_dir is not None
        self._ctx = zmq.Context() if self._own_context else (context or zmq.Context.instance())
        self._auth: Any = None
        self._inproc = f"inproc://remote-g2-rpc-{id(self):x}-{next(_server_ids)}"
        self._push: zmq.Socket | None = None
        self._push_lock = threading.Lock()
        self._pending = 0
        self._pending_lock = threading.Lock()
        self._ids = itertools.count(1)
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._pool: ThreadPoolExecutor | None = None
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
        """Bind and start serving in a background thread; return the bound endpoint."""
        if self._thread is not None:
            raise ConfigError("server already started")
        if self._workers:
            self._pool = ThreadPoolExecutor(self._workers, thread_name_prefix=f"{self.name}-rpc")
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-rpc-io", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            if self._pool:
                self._pool.shutdown(wait=False)
            raise self._start_error
        assert self._bound is not None
        return self._bound

    def serve_forever(self, stop: threading.Event | None = None) -> None:
        """Start (if needed) and block until ``stop`` is set or :meth:`close` is called."""
        if self._thread is None:
            self.start()
        assert self._thread is not None
        while self._thread.is_alive():
            if stop is not None and stop.wait(0.2):
                break
            self._thread.join(0.2)
        self.close()

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving; idempotent. In-flight handlers finish but their replies are dropped."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None and self._thread.is_alive():
            self._send_internal([_STOP])
            self._thread.join(timeout)
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        if self._own_context:
            self._ctx.term()

    def __enter__(self) -> RpcServer:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- I/O thread ------------------------------------------------------------

    def _run(self) -> None:
        router = self._ctx.socket(zmq.ROUTER)
        pull = self._ctx.socket(zmq.PULL)
        try:
            router.linger = 0
            # Hard cap well above the protocol limit: frames between the two get a
            # clean ERR; only absurd ones make libzmq drop the connection.
            router.maxmsgsize = 4 * self._max_frame
            if self._curve is not None:
                if self._curve.allowed_clients_dir is not None:
                    from zmq.auth.thread import ThreadAuthenticator

                    self._auth = ThreadAuthenticator(self._ctx)
                    self._auth.start()
                    self._auth.configure_curve(domain="*", location=str(self._curve.allowed_clients_dir))
                self._curve.apply(router)
            router.bind(self._endpoint)
            pull.bind(self._inproc)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.linger = 0
            self._push.connect(self._inproc)
            self._bound = router.getsockopt_string(zmq.LAST_ENDPOINT)
        except Exception as e:  # bind errors go back to start()
            self._start_error = ConfigError(f"{self.name}: cannot bind {self._endpoint}: {e}")
            router.close(0)
            pull.close(0)
            self._started.set()
            return
        self._started.set()
        log.info("%s serving on %s", self.name, self._bound)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(pull, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if pull in ready:
                    if not self._drain_replies(pull, router):
                        break
                if router in ready:
                    self._read_requests(router)
        finally:
            with self._push_lock:
                self._push.close(0)
                self._push = None
            router.close(0)
            pull.close(0)
            if self._auth is not None:
                self._auth.stop()
            log.info("%s stopped", self.name)

    def _drain_replies(self, pull: zmq.Socket, router: zmq.Socket) -> bool:
        """Forward replies from workers; False once the stop sentinel arrives."""
        while True:
            try:
                frames = pull.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return True
            if frames == [_STOP]:
                return False
            self._send(router, frames)

    def _read_requests(self, router: zmq.Socket) -> None:
        # Bounded batch so replies from workers are not starved by a flood.
        for _ in range(256):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._dispatch(router, frames)

    def _send(self, router: zmq.Socket, frames: list[bytes]) -> None:
        try:
            router.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            # The client's pipe is full (it stopped reading); dropping beats wedging the loop.
            log.warning("%s: dropped a reply to a client that is not reading", self.name)

    def _dispatch(self, router: zmq.Socket, frames: list[bytes]) -> None:
        t0 = time.perf_counter()
        peer = frames[0]
        if len(frames) != 2:
            self._send(router, [peer, encode_err(next(self._ids), None, "ProtocolError",
                                                 f"expected one frame per message, got {len(frames) - 1}")])
            self._observe("?", t0, "bad_request")
            return
        msg_id: int | None = None
        try:
            frame = decode_frame(frames[1], max_frame_bytes=self._max_frame)
            msg_id = frame.id
            if frame.re is not None:
                raise ProtocolError("a request must not carry header.re")
            spec, request = decode_request_body(frame)
        except ProtocolError as e:
            msg_id = msg_id if msg_id is not None else e.request_id
            self._send(router, [peer, encode_err(next(self._ids), msg_id, type(e).__name__, e.message)])
            self._observe("?", t0, "bad_request")
            return
        handler = self._handlers.get(spec.name)
        if handler is None:
            self._send(router, [peer, encode_err(next(self._ids), msg_id, "UnknownMessage",
                                                 f"{self.name} does not serve {spec.name!r}")])
            self._observe(spec.name, t0, "bad_request")
            return
        ctx = CallContext(peer, msg_id, spec.name, t0)
        if spec.name in self._inline or self._pool is None:
            self._send(router, [peer, self._invoke(handler, spec, request, ctx)])
            return
        with self._pending_lock:
            busy = self._pending >= self._max_pending
            if not busy:
                self._pending += 1
        if busy:
            self._send(router, [peer, encode_err(next(self._ids), msg_id, "ServerBusy",
                                                 f"{self.name} has {self._max_pending} requests in flight")])
            self._observe(spec.name, t0, "error")
            return
        try:
            self._pool.submit(self._invoke_in_worker, handler, spec, request, ctx)
        except RuntimeError:  # pool shut down: we are closing
            with self._pending_lock:
                self._pending -= 1

    # -- handlers ----------------------------------------------------------------

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

    def _invoke_in_worker(self, handler: Handler, spec: MessageSpec, request: Any, ctx: CallContext) -> None:
        try:
            data = self._invoke(handler, spec, request, ctx)
            self._send_internal([ctx.peer, data])
        finally:
            with self._pending_lock:
                self._pending -= 1

    def _send_internal(self, frames: list[bytes]) -> None:
        # The lock is also the memory barrier ZMQ asks for when a socket is shared.
        with self._push_lock:
            if self._push is not None:
                self._push.send_multipart(frames)

    def _observe(self, type_: str, t0: float, outcome: str) -> None:
        if self._on_call is not None:
            try:
                self._on_call(type_, time.perf_counter() - t0, outcome)
            except Exception:  # metrics must never break serving
                log.exception("%s: on_call observer failed", self.name)

    def _ping(self, request: Ping, ctx: CallContext) -> Pong:
        return Pong(server=self.name, version=remote_g2.__version__, uptime_s=time.monotonic() - self._t0)

    @property
    def pending(self) -> int:
        """Requests handed to workers and not yet answered."""
        return self._pending
