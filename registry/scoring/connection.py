"""One connection to the scoring API: aiohttp's request handler, plus its admission state and one deadline,
and the TLS handshake run under the same budget (:mod:`.admission`).

aiohttp parses (its C parser: llhttp, strict: a bare LF, a duplicate
Content-Length, a malformed length are refused with 400 and the connection
closed), keeps connections alive, pipelines and writes; this module adds
what aiohttp leaves to its user:

* **One deadline per connection**, a single timer moved lazily (a request
  is a fraction of a millisecond; a timer handle per request would cost as
  much as parsing it). A new connection has ``request_timeout_s`` from its
  accept to its first answer (TLS handshake, head and body included); after
  an answer it has ``idle_timeout_s`` to start the next request, and a
  request has ``request_timeout_s`` from its first byte to its last. A body
  late past it is answered 400 and the connection closed; anything else
  late (a head, a handshake, an idle keep-alive) is closed, and a client
  whose answers are left unread that long is reset.
* **Errors aiohttp answers itself** (a malformed head) get the API's JSON
  error body, are logged at debug level (attackers choose them), and a line
  over the limit or too many headers gets 431.
* **TLS handshakes** (:class:`TlsGate`) run after the accept, while the
  connection already counts in the unauthenticated budget, with
  ``request_timeout_s`` to finish; the connection is handed to aiohttp only
  then.
* **A fast path for the common request.** aiohttp hands each request to its
  connection's task and builds a request, a payload stream, a response and a
  writer for it: about 0.1 ms a request, a quarter of a score's cost
  (docs/benchmarks.md). On a connection that has authenticated and whose
  earlier requests are all answered, a request that aiohttp's parser has
  read whole (HTTP/1.1, no ``Expect``, no ``Connection: close``, not
  chunked) is answered in ``data_received`` by the same rules
  (:meth:`~.http_server.ScoreHttpServer.answer_inline`), its answer written
  at once. Anything else, and everything after it on that connection until
  aiohttp's task has answered it, goes aiohttp's way, so answers keep their
  order. Parsing stays aiohttp's in both paths. The fast path uses some of
  aiohttp's handler internals (``_FAST_PATH`` lists them); an aiohttp
  without them serves every request its own way.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import time
from email.utils import formatdate
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

from aiohttp import HttpVersion11, web
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import EMPTY_PAYLOAD
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from multidict import CIMultiDict

from .admission import source_of
from .json_wire import error_answer

if TYPE_CHECKING:
    from .http_server import _AiohttpServer

__all__ = ["ScoreConnection", "TlsGate", "RequestLate", "ANSWER_HEADERS"]

log = logging.getLogger("remote_g2.registry.score")

#: Every answer's headers but its length, date and Connection (aiohttp's): JSON, and a Server header that names
#: this API, not the HTTP library and its version (aiohttp's default) for an attacker to look up.
ANSWER_HEADERS = CIMultiDict({"Content-Type": "application/json", "Server": "remote-g2"})

_NEW, _IDLE, _HEAD, _BUSY = range(4)  # accepted / answered, waiting / a request's first bytes in / in the handler


#: What the fast path uses of aiohttp's RequestHandler beyond its public API (aiohttp 3.13 and 3.14 have it all).
#: With another aiohttp that lacks any of it, every request takes aiohttp's own path: slower, as correct.
_FAST_PATH = {"_waiter", "_messages", "_parser", "_paused", "_reading_paused", "_buffer_paused", "_force_close",
              "_close", "_msg_queue_resume_size", "_next_keepalive_close_time", "_keepalive_timeout"} \
    <= set(getattr(web.RequestHandler, "__slots__", ())) \
    | set(getattr(web.RequestHandler.__mro__[1], "__slots__", ())) \
    and hasattr(web.RequestHandler, "_resume_reading_if_drained") and hasattr(web.RequestHandler, "finish_response")

_date = ("", -1)  # (the Date header's line, for this second)
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_FIXED_HEADERS = "".join(f"{name}: {value}\r\n" for name, value in ANSWER_HEADERS.items())


def _head(status: int, length: int, keep: bool) -> bytes:
    """An answer's status line and headers (those aiohttp writes for a :class:`web.Response` of ours)."""
    global _date
    now = int(time.time())
    if _date[1] != now:
        _date = (f"Date: {formatdate(now, usegmt=True)}\r\n", now)
    return (f"{_STATUS_LINES[status]}{_FIXED_HEADERS}Content-Length: {length}\r\n{_date[0]}"
            f"{'' if keep else 'Connection: close' + chr(13) + chr(10)}\r\n").encode("latin-1")


class RequestLate(Exception):
    """The request did not arrive whole within the request timeout (set on its body's stream)."""


class ScoreConnection(web.RequestHandler):
    """aiohttp's handler of one connection, with the budgets' view of it (:class:`~.admission.Admitted`)."""

    def __init__(self, manager: _AiohttpServer, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self.site = manager.site
        self.source = ""
        self.authenticated = False
        self.admitted = False
        self.gone = False
        self.state = _NEW
        self.raw: asyncio.BaseTransport | None = None  # the TCP transport while a TLS handshake runs
        self.body_stream: Any = None  # the body being awaited, while it is
        self.inline_pending: Any = None  # (message, payload): the fast path's next request, its body still coming
        self.inline_busy = False  # in the fast path's loop (data_received may be re-entered from it)
        self.handed = False  # aiohttp's handler task holds requests of this connection (queued or in hand)
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- the budgets' view (admission.Admitted) ------------------------------------------------

    @property
    def idle(self) -> bool:
        return self.state != _BUSY

    def evict(self) -> None:
        self.gone = True
        transport = self.transport or self.raw
        if transport is not None:
            transport.abort()

    # -- aiohttp's callbacks, extended ---------------------------------------------------------------

    def admit(self, transport: asyncio.BaseTransport) -> None:
        """Count this connection in the unauthenticated budget and start its first deadline (at the accept)."""
        if self.admitted:
            return
        self.admitted = True
        self.source = source_of(transport.get_extra_info("peername"))
        self.site.admission.admit(self)
        self._expect(self.site.limits.request_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self.state == _IDLE:  # a new request's first bytes: its time starts now
            self.state = _HEAD
            self._expect(self.site.limits.request_timeout_s)
        messages = self._messages
        if self.inline_busy:  # re-entered (aiohttp resumes parsing with b"" as a body is read): the loop below
            waiter, self._waiter = self._waiter, None  # answers what this parses
            try:
                super().data_received(data)
            finally:
                self._waiter = waiter
            return
        pending = self.inline_pending
        if pending is None and (self.handed or messages or not self.authenticated or self._paused or not _FAST_PATH):
            super().data_received(data)  # aiohttp's way: each request in its handler task
            if messages:
                self.handed = True
            return
        # The fast path: aiohttp holds no request of this connection, which has authenticated. aiohttp parses
        # as always, but its task is not woken for the requests that are whole now: they are answered here, in
        # order, and only what is left (anything unusual) is handed to it. A plain request whose body is still
        # coming waits here for it, out of aiohttp's queue (inline_pending), unless reading was paused for it
        # (a body past aiohttp's read buffer: its task reads that).
        waiter = self._waiter
        self._waiter = None
        try:
            super().data_received(data)
        finally:
            self._waiter = waiter
        if pending is not None:
            self.inline_pending = None
            messages.appendleft(pending)
        self.inline_busy = True
        try:
            while messages:
                answered = self._answer_inline(*messages[0])
                if not answered and (answered is False or self._reading_paused or self._paused):
                    break
                message = messages.popleft()
                if self._parser is not None:
                    self._parser.message_consumed()
                if answered is None:  # its body is still coming: wait for it here
                    self.inline_pending = message
                    return
                if self._buffer_paused and len(messages) <= self._msg_queue_resume_size:
                    self._resume_reading_if_drained()
        finally:
            self.inline_busy = False
        if messages:
            self.handed = True
            if waiter is not None and not waiter.done():
                waiter.set_result(None)

    async def finish_response(self, request: web.BaseRequest, resp: web.StreamResponse,
                              start_time: float | None) -> tuple[web.StreamResponse, bool]:
        """aiohttp's, and once the last request it was handed is answered, the fast path may answer again."""
        try:
            return await super().finish_response(request, resp, start_time)
        finally:
            if not self._messages:
                self.handed = False

    def _answer_inline(self, message: Any, payload: Any) -> bool | None:
        """Answer a request that is whole and plain here: True; None for a plain one whose body is not all in;
        False (nothing done) to leave it to aiohttp's task."""
        transport = self.transport
        if (transport is None or self._force_close or self._close or self._paused
                or type(message) is not RawRequestMessage or message.version != HttpVersion11 or message.should_close
                or message.upgrade or message.chunked or "Expect" in message.headers):
            return False
        site = self.site
        if not payload.is_eof():  # worth waiting for only where the head alone would not be refused
            return None if site.wants_body(self, message.method, message.path, message.version,
                                           message.headers) else False
        site.answered_inline += 1
        body = payload.read_nowait() if payload is not EMPTY_PAYLOAD else b""
        status, answer, keep = site.answer_inline(self, message.method, message.path, message.version,
                                                  message.headers, body)
        transport.write(_head(status, len(answer), keep) + answer)
        if keep:
            self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
        else:
            self.force_close()
        return True

    def connection_lost(self, exc: BaseException | None) -> None:
        self.gone = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        super().connection_lost(exc)

    def request_started(self) -> None:
        if self.state == _IDLE:  # a pipelined request, read while the previous one was answered
            self._expect(self.site.limits.request_timeout_s)
        self.state = _BUSY

    def request_done(self) -> None:
        """The answer is about to be written: the next request (or the reading of this answer) may take the
        idle timeout."""
        self.state = _IDLE
        self._expect(self.site.limits.idle_timeout_s)

    def handle_error(self, request: web.BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's own answers (a head it refused; a bug past our handler): JSON, and the connection closes."""
        if request.writer.output_size > 0:
            raise ConnectionError("an answer was partly written: the connection cannot carry another")
        if status >= 500:
            log.error("score API: %s", message or "internal error", exc_info=exc)
            body = error_answer("internal", "internal error (logged by the server)")
        else:
            text = exc.message if isinstance(exc, HttpProcessingError) else (message or str(exc or ""))
            text = str(text).strip().split("\n", 1)[0][:200]
            if isinstance(exc, LineTooLong) or "Too many headers" in text:
                status = 431
            log.debug("score API: refused a request from %s: %s", request.remote, text)
            body = error_answer("bad_request", f"malformed request: {text}")
        self.state = _IDLE
        resp = web.Response(status=status, body=body, headers=ANSWER_HEADERS)
        resp.force_close()
        return resp

    # -- the deadline ----------------------------------------------------------------------------------

    def _expect(self, seconds: float) -> None:
        loop = self._loop
        self.deadline = deadline = loop.time() + seconds
        timer = self.timer
        if timer is not None and timer.when() > deadline:  # moved earlier: only then a new timer
            timer.cancel()
            timer = None
        if timer is None and not self.gone:
            self.timer = loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.gone:
            return
        if self._loop.time() < self.deadline:  # moved on since it was set: wait for what is left
            self.timer = self._loop.call_at(self.deadline, self._on_timer)
            return
        if self.body_stream is not None:  # the handler answers 400 and closes
            self.body_stream.set_exception(RequestLate())
            return
        if self.inline_pending is not None and self.transport is not None:  # a body late for the fast path
            self.inline_pending = None
            late = error_answer("bad_request", "the request did not arrive within "
                                f"{self.site.limits.request_timeout_s:g} s")
            self.transport.write(_head(400, len(late), False) + late)
            self.gone = True
            self.force_close()
            return
        transport = self.transport
        if transport is None or transport.get_write_buffer_size() > 0:  # a handshake; or answers unread
            self.evict()
        else:  # idle, or a head that stopped halfway
            self.gone = True
            self.force_close()


class TlsGate(asyncio.Protocol):
    """A TLS connection until its handshake ends: admitted (and evictable) from the accept, the handshake
    bounded by the request timeout, then handed to its :class:`ScoreConnection`."""

    def __init__(self, manager: _AiohttpServer, context: ssl.SSLContext, authenticated_by_certificate: bool) -> None:
        self.manager = manager
        self.context = context
        self.by_certificate = authenticated_by_certificate
        self.conn: ScoreConnection | None = None
        self.pending: list[bytes] = []  # application data that came with the handshake's end
        self.lost: list[BaseException | None] = []
        self.task: asyncio.Task[None] | None = None
        self.started = False  # start_tls called: what is read from now on is the TLS layer's

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.pause_reading()  # type: ignore[attr-defined]  # the ClientHello is start_tls's to read
        conn = self.conn = self.manager()
        conn.raw = transport
        conn.admit(transport)
        self.task = asyncio.get_running_loop().create_task(self._handshake(transport))

    async def _handshake(self, raw: Any) -> None:
        conn = self.conn
        assert conn is not None
        loop = asyncio.get_running_loop()
        site = conn.site
        self.started = True
        try:
            tls = await loop.start_tls(raw, self, self.context, server_side=True,
                                       ssl_handshake_timeout=site.limits.request_timeout_s)
        except (OSError, ssl.SSLError, asyncio.TimeoutError, RuntimeError) as e:
            log.debug("score API: TLS handshake from %s failed: %r", conn.source, e)
            tls = None
        if tls is None or conn.gone or self.lost:
            conn.gone = True
            (tls or raw).abort()
            site.admission.release(conn)
            if conn.timer is not None:
                conn.timer.cancel()
            return
        conn.raw = None
        tls.set_protocol(conn)
        conn.connection_made(tls)
        if self.by_certificate and not conn.authenticated:  # the handshake proved it: a certificate the CA signed
            site.authenticate(conn)
        if self.pending:
            conn.data_received(b"".join(self.pending))

    def data_received(self, data: bytes) -> None:
        if self.conn is not None and self.conn.raw is not None and self.task is not None and not self.started:
            # bytes read before start_tls took the reads: the pause did not hold (not asyncio's loop?)
            log.error("score API: a TLS connection was read before its handshake began; closing it")
            self.conn.evict()
            return
        self.pending.append(data)

    def eof_received(self) -> bool | None:
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost.append(exc)
        conn = self.conn
        if conn is not None and conn.raw is not None:  # before the hand-over: the handshake task sees it fail
            conn.gone = True
            conn.site.admission.release(conn)
