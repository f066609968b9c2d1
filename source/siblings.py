"""Rank 0 ↔ sibling ranks: the IPC sockets, the sibling handlers, the concurrent fan-out.

Every rank ``r > 0`` serves ``sibling_resolve`` / ``sibling_pin`` /
``sibling_trim`` / ``sibling_release`` / ``sibling_renew`` on ``ipc://{dir}/{worker_id}_tp{r}.sock``
from its own :class:`~remote_g2.source.leases.LeaseTable` (see
:func:`sibling_handlers`). The directory is private (mode 0700, owned by this
user), checked every time a rank starts.

Rank 0 reaches them through :class:`SiblingLinks`: :meth:`SiblingLinks.begin`
sends one request to every sibling at once from the calling thread (its own
DEALER socket per sibling, so concurrent resolves never share a socket or a
lock) and yields the CPU once so that they leave at once, rank 0 pins locally
meanwhile, and :meth:`PendingCalls.wait` polls all the sockets together.
This saves a thread hand-off per fan-out against a thread pool of
RpcClients (docs/benchmarks.md, "One-off measurements"). A sibling that
did not answer is skipped for ``retry_after_s`` (calls to it fail at once),
so a dead rank costs one timeout, not one per resolve.

Only a sibling that did not answer (hung, dead, or too slow) is a *failure*
(``on_failure``, the ``sibling_failures`` metric operators page on). A
sibling that answered ``ERR`` is alive and well: it refused the call
(``on_refusal``) — for ``sibling_resolve`` usually because the target's
frame was malformed, which rank 0's own server refuses and counts too.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import zmq

from remote_g2.errors import ProtocolError, RpcTimeout, SiblingUnavailable, SourceError, TransportError
from remote_g2.protocol.messages import (
    ErrorReply, GatherWish, Resolve, SiblingAck, SiblingPin, SiblingPinReply, SiblingRelease, SiblingRenew,
    SiblingResolve, SiblingTrim, spec_for_request,
)
from remote_g2.rpc.client import error_from_reply
from remote_g2.rpc.server import CallContext, Handler
from remote_g2.protocol.wire import ERR, decode_frame, decode_reply_body, decode_request, encode_request

from .gather import Gatherer
from .leases import LeaseTable

__all__ = ["SiblingLinks", "PendingCalls", "sibling_handlers"]

log = logging.getLogger("remote_g2.source.siblings")


def sibling_handlers(table: LeaseTable, *, max_ttl_ms: int, lease_ttl_ms: Callable[[int], int],
                     on_release: Callable[[], None] | None = None,
                     gatherer: Gatherer | None = None) -> dict[str, Handler]:
    """The handlers a sibling rank serves over its IPC socket (``on_release``: a lease ended by release).

    A pin that carries a gather wish stages this rank's parts with
    ``gatherer`` right after pinning (``source/gather.py``; None: never).

    ``lease_ttl_ms``: the clamp rank 0 applies to a resolve's TTL
    (:meth:`~remote_g2.source.config.SourceConfig.lease_ttl_ms`), applied
    here to the target's own ``ttl_ms`` that ``sibling_resolve`` carries;
    the other messages carry rank 0's clamped TTL, capped at ``max_ttl_ms``.
    Every share is pinned for, and ended or extended only for, the ``owner``
    rank 0 names: the connection that resolved the lease.
    """

    def staged(lease_id: int, ids: list[int], wish: GatherWish | None) -> SiblingPinReply:
        return SiblingPinReply(ids, gatherer.stage(lease_id, ids, wish) if gatherer is not None else [])

    def pin(req: SiblingPin, ctx: CallContext) -> SiblingPinReply:
        ttl_s = min(req.ttl_ms, max_ttl_ms) / 1000.0
        ids = table.pin_charged(req.lease_id, req.hashes, time.monotonic() + ttl_s, req.owner)
        return staged(req.lease_id, ids, req.gather)

    def pin_forwarded(req: SiblingResolve, ctx: CallContext) -> SiblingPinReply:
        received = time.monotonic()  # the lease's clock starts here, after rank 0's
        # Exactly rank 0's server's checks: a frame it refuses is refused here, and nothing is pinned.
        _, spec, resolve = decode_request(req.resolve)
        if not isinstance(resolve, Resolve):
            raise ProtocolError(f"sibling_resolve carries a {spec.name!r} frame, not a resolve")
        deadline = received + lease_ttl_ms(resolve.ttl_ms) / 1000.0
        ids = table.pin_charged(req.lease_id, resolve.hashes, deadline, req.owner)
        return staged(req.lease_id, ids, resolve.gather)

    def trim(req: SiblingTrim, ctx: CallContext) -> SiblingAck:
        return SiblingAck(table.trim(req.lease_id, req.keep))

    def release(req: SiblingRelease, ctx: CallContext) -> SiblingAck:
        known = table.release(req.lease_id, req.owner)
        if known and on_release is not None:
            on_release()
        return SiblingAck(known)

    def renew(req: SiblingRenew, ctx: CallContext) -> SiblingAck:
        ttl_s = min(req.ttl_ms, max_ttl_ms) / 1000.0
        return SiblingAck(table.renew(req.lease_id, time.monotonic() + ttl_s, req.owner))

    return {"sibling_pin": pin, "sibling_resolve": pin_forwarded, "sibling_trim": trim, "sibling_release": release,
            "sibling_renew": renew}


class SiblingLinks:
    """Rank 0's calls to its siblings (``endpoints``: rank → IPC endpoint), all in flight at once.

    :meth:`begin` sends one request to each sibling right away and returns a
    :class:`PendingCalls`; the caller does its own work (rank 0's local pin)
    and then :meth:`PendingCalls.wait` polls every sibling's socket at once
    until each has answered or the timeout passed. No thread hop: each
    calling thread owns one DEALER socket per sibling (ZMQ sockets are not
    thread-safe), and a reply that arrives after its call timed out is
    recognised by its id and dropped the next time that socket is used.
    """

    def __init__(self, endpoints: dict[int, str], *, timeout_ms: float, retry_after_s: float,
                 on_failure: Callable[[int, str, Exception], None] | None = None,
                 on_refusal: Callable[[int, str, Exception], None] | None = None,
                 context: zmq.Context | None = None) -> None:
        self.endpoints = dict(endpoints)
        self.timeout_ms = timeout_ms
        self._retry_after = retry_after_s
        self._on_failure = on_failure
        self._on_refusal = on_refusal
        self._ctx = context or zmq.Context.instance()
        self._local = threading.local()
        self._sockets: list[zmq.Socket] = []
        self._lock = threading.Lock()
        self._down_until: dict[int, float] = {}
        self._closed = False

    @property
    def ranks(self) -> list[int]:
        return sorted(self.endpoints)

    def down(self) -> list[int]:
        """Siblings that failed within the last ``retry_after_s``."""
        now = time.monotonic()
        return [r for r, t in list(self._down_until.items()) if t > now]

    def begin(self, make: Callable[[int], Any], ranks: Iterable[int] | None = None, *,
              fail_fast: bool = False) -> PendingCalls:
        """Send ``make(rank)`` to each rank now; wait for the answers with :meth:`PendingCalls.wait`.

        With ``fail_fast`` a rank marked down fails at once with
        :class:`SiblingUnavailable` instead of being called. Dropping the
        result without waiting is a fire-and-forget call.
        """
        pending = PendingCalls(self)
        now = time.monotonic()
        sent = False
        for rank in self.ranks if ranks is None else ranks:
            request = make(rank)
            if self._closed:
                pending.failed(rank, request, SourceError("the source is shutting down"))
                continue
            if fail_fast and self._down_until.get(rank, 0.0) > now:
                pending.failed(rank, request, SiblingUnavailable(
                    f"TP rank {rank} failed recently; retrying it after {self._retry_after:g} s"))
                continue
            link = self._link(rank)
            link.drain()  # late replies to calls nobody waits for any more
            msg_id = next(link.ids)
            try:
                link.sock.send(encode_request(msg_id, request), zmq.NOBLOCK)
            except zmq.ZMQError as e:  # queue full: the rank has not been reading for a while
                pending.failed(rank, request, TransportError(f"calling {type(request).WIRE_NAME} on "
                                                             f"{self.endpoints[rank]}: {e}"))
                continue
            pending.sent(rank, request, link, msg_id)
            sent = True
        if sent:
            # Let this process's ZMQ I/O thread push the requests out now. It was woken by the sends, but
            # on a core it shares with this thread (ranks bound to cores) it would run only once this
            # thread blocks — after rank 0's own pinning, which is meant to overlap the siblings' work
            # (a perf sched trace with ranks bound showed the request leaving only after that pinning).
            os.sched_yield()
        return pending

    def call_all(self, make: Callable[[int], Any], ranks: Iterable[int] | None = None, *,
                 fail_fast: bool = False) -> dict[int, Any]:
        """:meth:`begin` then wait: rank → reply, or the exception that call ended with."""
        return self.begin(make, ranks, fail_fast=fail_fast).wait()

    def _link(self, rank: int) -> _Link:
        links: dict[int, _Link] | None = getattr(self._local, "links", None)
        if links is None:
            links = self._local.links = {}
        link = links.get(rank)
        if link is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.linger = 0
            sock.sndhwm = sock.rcvhwm = 1000
            sock.connect(self.endpoints[rank])
            link = links[rank] = _Link(sock, itertools.count(1))
            with self._lock:
                self._sockets.append(sock)
        return link

    def _settled(self, rank: int, call: str, outcome: Any) -> None:
        if isinstance(outcome, SiblingUnavailable):
            return  # not a call: the rank is already known to be down
        if isinstance(outcome, TransportError):  # no answer: the rank may be gone
            self._down_until[rank] = time.monotonic() + self._retry_after
            if self._on_failure is not None:
                self._on_failure(rank, call, outcome)
            return
        self._down_until.pop(rank, None)  # it answered: alive
        if isinstance(outcome, BaseException) and self._on_refusal is not None:
            self._on_refusal(rank, call, outcome)

    def close(self) -> None:
        """Close every socket; call after the threads that used them stopped."""
        self._closed = True
        with self._lock:
            for sock in self._sockets:
                sock.close(0)
            self._sockets.clear()


@dataclass(slots=True)
class _Link:
    """One thread's socket to one sibling; ids increase, so a late reply never matches a new call."""

    sock: zmq.Socket
    ids: Iterator[int]

    def drain(self) -> None:
        while self.sock.poll(0, zmq.POLLIN):
            self.sock.recv()


class PendingCalls:
    """Calls sent by :meth:`SiblingLinks.begin`; :meth:`wait` collects them (once, same thread)."""

    def __init__(self, links: SiblingLinks) -> None:
        self._links = links
        self._open: dict[int, tuple[Any, _Link, int]] = {}
        self._done: dict[int, Any] = {}
        self._t0 = time.monotonic()

    def sent(self, rank: int, request: Any, link: _Link, msg_id: int) -> None:
        self._open[rank] = (request, link, msg_id)

    def failed(self, rank: int, request: Any, error: Exception) -> None:
        self._done[rank] = error
        self._links._settled(rank, type(request).WIRE_NAME, error)

    def wait(self) -> dict[int, Any]:
        """Every rank's reply dataclass or exception, in at most the links' timeout."""
        links = self._links
        deadline = self._t0 + links.timeout_ms / 1000.0
        while self._open:
            left_ms = (deadline - time.monotonic()) * 1000.0
            if left_ms <= 0:
                break
            poller = zmq.Poller()
            by_sock = {}
            for rank, (_, link, _) in self._open.items():
                poller.register(link.sock, zmq.POLLIN)
                by_sock[link.sock] = rank
            for sock, _ in poller.poll(max(1, int(left_ms))):
                rank = by_sock[sock]
                self._read(rank)
        for rank, (request, _, _) in list(self._open.items()):
            name = type(request).WIRE_NAME
            self._finish(rank, RpcTimeout(f"calling {name} on {links.endpoints[rank]}: no reply within "
                                          f"{links.timeout_ms:g} ms", call=name, endpoint=links.endpoints[rank],
                                          timeout_ms=links.timeout_ms))
        return self._done

    def _read(self, rank: int) -> None:
        request, link, msg_id = self._open[rank]
        while link.sock.poll(0, zmq.POLLIN):
            raw = link.sock.recv()
            try:
                frame = decode_frame(raw)
                # An ERR without ``re`` means the sibling could not read our id: it is about this call.
                if frame.re != msg_id and not (frame.re is None and frame.type == ERR):
                    continue  # a late reply to a call that timed out earlier
                body = decode_reply_body(frame, spec_for_request(type(request)))
            except ProtocolError as e:
                self._finish(rank, e)
                return
            endpoint = self._links.endpoints[rank]
            self._finish(rank, error_from_reply(body, endpoint) if isinstance(body, ErrorReply) else body)
            return

    def _finish(self, rank: int, outcome: Any) -> None:
        request, _, _ = self._open.pop(rank)
        self._done[rank] = outcome
        self._links._settled(rank, type(request).WIRE_NAME, outcome)
