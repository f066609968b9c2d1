"""Calls, from frame to reply: the handler contract every RPC transport serves (:class:`Dispatcher`).

A transport reads request frames and hands them over in batches of
``(identity, [peer, frame])``; :meth:`Dispatcher.dispatch` validates each
(a malformed, oversized or unknown frame is answered ``ERR`` at once), runs
its type's arrival hook and handler, or groups the calls of a type with a
*batch handler* into one call, and returns the reply frames with the peers
they go to, plus the batches a handler answered with a :class:`Deferred`,
which :meth:`Dispatcher.settle` answers once they are ready. The transport
sends the replies; nothing here touches a socket, blocks or starts a thread.
Used by :class:`~remote_g2.rpc.server.RpcServer`'s serving modes
(:mod:`remote_g2.rpc.serving`) and by :class:`~remote_g2.rpc.stream.StreamRpcServer`.

Contract for handlers: ``handler(request, ctx) -> reply`` where ``request`` is
the validated request dataclass and ``reply`` an instance of the message's
reply class. Handlers may run concurrently on different threads. Raising a
:class:`~remote_g2.errors.RemoteG2Error` answers ``ERR`` with that class's
name; any other exception answers ``ERR InternalError`` and is logged with its
traceback. ``ping`` is answered by every dispatcher unless a handler overrides it.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import remote_g2
from remote_g2.errors import ConfigError, ProtocolError, RemoteG2Error
from remote_g2.log import RateLimitedLog
from remote_g2.protocol.messages import MESSAGES, MessageSpec, Ping, Pong
from remote_g2.protocol.wire import decode_request, encode_err, encode_ok, peek_type

__all__ = ["Dispatcher", "CallContext", "Handler", "BatchHandler", "CallObserver", "Deferred", "Arrival",
           "ArrivalHook", "Request", "Reply"]

log = logging.getLogger("remote_g2.rpc")


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


#: A request as a transport hands it over: ``(identity, [peer, frame…])`` (identity: None unless drawn).
Request = tuple[bytes | None, list[bytes]]
#: A reply as a transport sends it: ``(peer, frame)``.
Reply = tuple[bytes, bytes]


class Dispatcher:
    """The handlers of one server (message name → handler or batch handler), and how a call reaches them.

    ``name`` is the server's (in ``ping``'s answer, ``ERR`` texts and logs);
    ``on_call`` observes every call's time and outcome. Raises
    :class:`~remote_g2.errors.ConfigError` for handlers of unknown or one-way
    types, a type with both kinds of handler, or an arrival hook without a
    handler. Thread-safe as long as the handlers are.
    """

    def __init__(self, name: str, handlers: Mapping[str, Handler], *,
                 batch_handlers: Mapping[str, BatchHandler] | None = None,
                 on_arrival: Mapping[str, ArrivalHook] | None = None,
                 max_frame_bytes: int, on_call: CallObserver | None = None) -> None:
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
        self.name = name
        self.handlers: dict[str, Handler] = {"ping": self._ping, **handlers}
        self.batch_handlers = batch_handlers
        self._on_arrival = on_arrival
        self.max_frame = max_frame_bytes
        self._on_call = on_call
        #: header ids of the frames this server sends (a transport's own ERR frames draw from it too)
        self.ids = itertools.count(1)
        self._hostile = RateLimitedLog(log)
        self._t0 = time.monotonic()

    def dispatch(self, batch: list[Request]) -> tuple[list[Reply], list[Any]]:
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
            if spec.name in self.batch_handlers:
                grouped.setdefault(spec.name, []).append((request, ctx))
            else:
                out.append((ctx.peer, self._invoke(self.handlers[spec.name], spec, request, ctx)))
        for name, calls in grouped.items():
            spec = MESSAGES[name]
            try:
                replies = self.batch_handlers[name](calls)
            except Exception as e:
                out.extend((ctx.peer, self._answer_error(spec, ctx, e)) for _, ctx in calls)
                continue
            if isinstance(replies, list):
                out.extend(self._answer_batch(spec, calls, replies))
            else:
                later.append((replies, spec, calls))
        return out, later

    def settle(self, deferred: Deferred, spec: MessageSpec,
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
        hook = self._on_arrival.get(peek_type(frames[1], max_frame_bytes=self.max_frame) or "")
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
            self.observe("?", t0, "bad_request")
            self.note_malformed(f"{len(frames) - 1} frames in one message")
            return encode_err(next(self.ids), None, "ProtocolError",
                              f"expected one frame per message, got {len(frames) - 1}")
        try:
            frame, spec, request = decode_request(frames[1], max_frame_bytes=self.max_frame)
        except ProtocolError as e:
            self.observe("?", t0, "bad_request")
            self.note_malformed(e.message)
            return encode_err(next(self.ids), e.request_id, type(e).__name__, e.message)  # its id when readable
        if spec.name not in self.handlers and spec.name not in self.batch_handlers:
            self.observe(spec.name, t0, "bad_request")
            self.note_malformed(f"{spec.name!r} is not served here")
            return encode_err(next(self.ids), frame.id, "UnknownMessage", f"{self.name} does not serve {spec.name!r}")
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
            data = encode_ok(next(self.ids), ctx.msg_id, reply)
        except Exception as e:  # a reply the wire cannot carry (e.g. an id a packed list cannot hold)
            return self._answer_error(spec, ctx, e)
        self.observe(spec.name, ctx.received_at, "ok")
        return data

    def _answer_error(self, spec: MessageSpec, ctx: CallContext, e: Exception) -> bytes:
        if isinstance(e, RemoteG2Error):
            data = encode_err(next(self.ids), ctx.msg_id, type(e).__name__, e.message)
        else:
            log.error("%s: handler for %s failed", self.name, spec.name, exc_info=e)
            data = encode_err(next(self.ids), ctx.msg_id, "InternalError", f"{type(e).__name__}: {e}")
        self.observe(spec.name, ctx.received_at, "error")
        return data

    def observe(self, type_: str, t0: float, outcome: str) -> None:
        if self._on_call is not None:
            try:
                self._on_call(type_, time.perf_counter() - t0, outcome)
            except Exception:  # metrics must never break serving
                log.exception("%s: on_call observer failed", self.name)

    def _ping(self, request: Ping, ctx: CallContext) -> Pong:
        return Pong(server=self.name, version=remote_g2.__version__, uptime_s=time.monotonic() - self._t0)
