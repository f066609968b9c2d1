"""The scoring API over HTTP/1.1 (``remote-g2 serve --score-bind``): routers ask, the :class:`~.scoring.Scorer` answers.

Routes (bodies are JSON, :mod:`.score_wire` reads and writes them; every
answer is JSON, errors included)::

    POST /v1/score   remote-g2's own shape            -> {"model", "num_tokens", "best", "workers", "unscored"}
    POST /query      Dynamo's and Mooncake's shape    -> {"scores", "instances"}
    GET  /healthz    -> {"ok": true}

Errors: ``{"error": {"reason", "message"}}`` with 400 (malformed: bad JSON,
bad UTF-8, wrong types), 401 (no or wrong bearer token), 404, 405, 411 (no
Content-Length), 413 (a body over ``max_body`` bytes, a prompt over the
scorer's limit), 422 (well-formed but not scorable exactly: an unknown hash
scheme, a seed not configured), 431 (a request head over 16 KiB), 500 (a
bug: logged) and 503 (the store is unreachable). The connection is closed
after any error that leaves the stream in doubt; otherwise it is kept alive
(HTTP/1.1; pipelined requests are answered in order).

Who may ask: "is this prompt cached anywhere?" is a prompt-probing
attacker's question (docs/security.md), so a bind beyond loopback needs a
bearer token (``Authorization: Bearer <token>``; several tokens may be
valid at once, for rotation), compared in constant time, or TLS with client
certificates (:func:`tls_context` with a client CA). HTTPS without client
certificates keeps a token from being read on the wire. A request without a
valid token is refused before its body is read.

One thread runs an asyncio loop; each connection is an :class:`asyncio.Protocol`
that parses HTTP from its own buffer, strictly and only as far as this API
needs (a request line, headers up to 16 KiB, a body of exactly
``Content-Length`` bytes; ``Expect: 100-continue`` honoured; chunked bodies
refused with 411), and scores each complete request inline, on the loop: the
work is CPU-bound and short (a Redis store's lookup blocks the loop for its
round trip). A protocol rather than stream readers because a score is a
fraction of a millisecond and the streams' per-request machinery (a task
wake-up per read, read pauses on every 64 KiB of an 8,192-token body) cost
as much as the score. Limits: a request's head and body must arrive within
10 s of its first byte (slow clients are cut off), an idle kept-alive
connection is closed after 60 s, at most 512 connections are open at once,
and a client that stops reading its answers is not read from until it does
(and is disconnected when it has not caught up within 60 s).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from typing import Any

from remote_g2.errors import CannotScore, ConfigError, StoreUnavailable
from remote_g2.net_address import is_loopback

from .score_wire import error_answer, query_answer, query_request, request_from_json, score_answer
from .scoring import Scorer

__all__ = ["ScoreHttpServer", "parse_bind", "tls_context", "DEFAULT_MAX_BODY"]

log = logging.getLogger("remote_g2.registry.score")

DEFAULT_MAX_BODY = 4 << 20  # 4 MiB: a 262,144-token prompt as JSON is under 2 MiB
_MAX_HEAD = 16 << 10
_REQUEST_TIMEOUT_S = 10.0  # from a request's first byte to its last (slow-loris)
_IDLE_TIMEOUT_S = 60.0  # a kept-alive connection with nothing to say
_MAX_CONNECTIONS = 512
_SINGLE_HEADERS = frozenset({"content-length", "transfer-encoding", "authorization", "expect"})
_STATUS = {200: "OK", 100: "Continue", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 411: "Length Required", 413: "Content Too Large", 422: "Unprocessable Content",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_REASON_STATUS = {"bad_request": 400, "too_large": 413, "unknown_scheme": 422, "seed_unknown": 422,
                  "unsupported_input": 422}
_ROUTES = ("/v1/score", "/query")


class _HttpError(Exception):
    def __init__(self, status: int, reason: str, message: str, *, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.reason, self.message, self.close = status, reason, message, close


def tls_context(cert: str, key: str, client_ca: str | None = None) -> ssl.SSLContext:
    """A server context for HTTPS (TLS 1.2+); with ``client_ca``, clients must present a certificate it signed."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(cert, key)
        if client_ca:
            ctx.load_verify_locations(client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"scoring API TLS: {e}") from None
    return ctx


def parse_bind(bind: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) -> (host, port); ConfigError otherwise."""
    host, sep, port = bind.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--score-bind {bind!r}: expected HOST:PORT")
    return host, int(port)


class _Head:
    """A parsed request head: what the body and the answer need."""

    __slots__ = ("method", "path", "length", "keep", "started")

    def __init__(self, method: str, path: str, length: int, keep: bool, started: float) -> None:
        self.method, self.path, self.length, self.keep, self.started = method, path, length, keep, started


class _Connection(asyncio.Protocol):
    """One client connection: buffer, parse, score, answer; see the module docstring for the limits."""

    def __init__(self, server: ScoreHttpServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server, self.loop = server, loop
        self.transport: asyncio.Transport | None = None
        self.buf = bytearray()
        self.scanned = 0  # bytes of buf already searched for the head's end
        self.head: _Head | None = None
        self.paused = False  # the client is not reading its answers: not read from either
        self.closed = False
        # One timer per connection, moved lazily: ``deadline`` changes per request, and the timer, when it
        # fires early, re-arms itself for what is left (cheaper than a new timer handle per request).
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    # -- asyncio callbacks -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        conns = self.server._connections
        if len(conns) >= _MAX_CONNECTIONS:
            self.closed = True
            transport.abort()
            return
        conns.add(self)
        self._arm(_IDLE_TIMEOUT_S)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server._connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        if not self.buf and self.head is None:  # a new request's first byte: its time starts now
            self._arm(_REQUEST_TIMEOUT_S)
        self.buf += data
        try:
            self._serve_buffered()
        except Exception:  # a bug: this connection ends, the server keeps serving
            log.exception("score API: connection failed")
            self._answer(500, error_answer("internal", "internal error (logged by the server)"), keep=False)

    def eof_received(self) -> bool:
        # The client is done sending. A request cut short is answered; then what was written goes out and
        # the transport closes.
        if not self.closed and (self.buf or self.head is not None):
            self._answer(400, error_answer("bad_request", "the request ended early (before its head's end or "
                                           "Content-Length bytes of body)"), keep=False)
        return False

    def pause_writing(self) -> None:
        self.paused = True
        self._arm(_IDLE_TIMEOUT_S)  # a client that reads none of its answers for this long is cut off
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        if self.transport is not None and not self.closed:
            self._arm(_REQUEST_TIMEOUT_S if self.buf or self.head is not None else _IDLE_TIMEOUT_S)
            self.transport.resume_reading()
            self._serve_buffered()

    # -- requests ----------------------------------------------------------------------------------

    def _serve_buffered(self) -> None:
        """Answer every complete request in the buffer, in order (stops at a partial one, or when paused)."""
        while not self.closed and not self.paused:
            head = self.head
            if head is None:
                buf = self.buf
                end = buf.find(b"\r\n\r\n", max(0, self.scanned - 3))
                if end < 0 or end + 4 > _MAX_HEAD:
                    if len(buf) > _MAX_HEAD or end >= 0:
                        self._answer(431, error_answer("bad_request", f"request head over {_MAX_HEAD} bytes"),
                                     keep=False)
                    self.scanned = len(buf)
                    return
                raw = bytes(buf[:end])
                del buf[:end + 4]
                self.scanned = 0
                try:
                    head = self._parse_head(raw)
                except _HttpError as e:
                    self._answer(e.status, error_answer(e.reason, e.message), keep=not e.close)
                    continue
                self.head = head
            if len(self.buf) < head.length:
                return  # the rest of the body is on its way (or the timer cuts it off)
            if head.length == len(self.buf):
                body, self.buf = self.buf, bytearray()  # the usual case: the buffer is the body, no copy
            else:
                body = self.buf[:head.length]
                del self.buf[:head.length]
            self.head = None
            try:
                status, payload = 200, self._route(head, body)
                keep = head.keep
            except _HttpError as e:
                status, payload, keep = e.status, error_answer(e.reason, e.message), head.keep and not e.close
            self._answer(status, payload, keep=keep)
            self.server._observe(status, time.perf_counter() - head.started)
            if not self.closed and not self.paused:  # (paused: pause_writing set the time it may take)
                self._arm(_REQUEST_TIMEOUT_S if self.buf else _IDLE_TIMEOUT_S)

    def _parse_head(self, raw: bytes) -> _Head:
        """The request line and headers; refusals that leave the stream in doubt close the connection."""
        started = time.perf_counter()
        try:
            lines = raw.decode("latin-1").split("\r\n")
            method, target, version = lines[0].split(" ")
        except ValueError:
            raise _HttpError(400, "bad_request", "malformed request line", close=True) from None
        if version not in ("HTTP/1.1", "HTTP/1.0"):
            raise _HttpError(400, "bad_request", f"unsupported protocol {version[:16]!r}", close=True)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise _HttpError(400, "bad_request", "malformed header line", close=True)
            key = name.lower()
            if key in _SINGLE_HEADERS and key in headers:
                # two lengths (or two tokens) leave it in doubt where this request ends (or who sent it)
                raise _HttpError(400, "bad_request", f"{name} given twice", close=True)
            headers[key] = value.strip()
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        if "transfer-encoding" in headers:
            raise _HttpError(411, "bad_request", "chunked bodies are not accepted: send Content-Length", close=True)
        length_text = headers.get("content-length", "0")
        if not (length_text.isascii() and length_text.isdigit()):  # (isdigit alone takes "²", which int() refuses)
            raise _HttpError(400, "bad_request", "malformed Content-Length", close=True)
        if len(length_text) > 18:  # over any max_body (and int() refuses 4,300 digits with a ValueError)
            raise _HttpError(413, "too_large", f"a body of {len(length_text)} digits of bytes", close=True)
        length = int(length_text)
        if length > self.server.max_body:
            raise _HttpError(413, "too_large", f"a body of {length} bytes (at most {self.server.max_body})",
                             close=True)
        path = target.split("?", 1)[0]
        if path != "/healthz" and not self.server._authorized(headers.get("authorization", "")):
            # refused before its body is read (or, with Expect: 100-continue, sent): the connection closes
            raise _HttpError(401, "unauthorized", "a bearer token is required", close=True)
        if length > len(self.buf) and headers.get("expect", "").lower() == "100-continue":
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")  # type: ignore[union-attr]
        return _Head(method, path, length, keep, started)

    def _route(self, head: _Head, body: bytes | bytearray) -> bytes:
        path, method = head.path, head.method
        if path == "/healthz":
            if method != "GET":
                raise _HttpError(405, "bad_request", f"{method[:16]} {path}: use GET")
            return b'{"ok":true}'
        if path not in _ROUTES:
            raise _HttpError(404, "not_found", f"no route {path[:128]!r} (POST /v1/score, POST /query, GET /healthz)")
        if method != "POST":
            raise _HttpError(405, "bad_request", f"{method[:16]} {path}: use POST")
        return self.server._score(body, path)

    def _answer(self, status: int, payload: bytes, *, keep: bool) -> None:
        transport = self.transport
        if self.closed or transport is None:
            return
        extra = 'WWW-Authenticate: Bearer realm="remote-g2"\r\n' if status == 401 else ""
        head = (f"HTTP/1.1 {status} {_STATUS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n{extra}Connection: {'keep-alive' if keep else 'close'}\r\n\r\n")
        transport.write(head.encode() + payload)
        if not keep:
            self.closed = True
            transport.close()  # after what was written goes out

    # -- time limits ---------------------------------------------------------------------------------

    def _arm(self, seconds: float) -> None:
        self.deadline = deadline = self.loop.time() + seconds
        timer = self.timer
        if timer is not None and timer.when() > deadline:  # moved earlier: only then a new timer
            timer.cancel()
            timer = None
        if timer is None:
            self.timer = self.loop.call_at(deadline, self._on_timer)

    def _on_timer(self) -> None:
        self.timer = None
        if self.closed:
            return
        if self.loop.time() < self.deadline:  # moved on since it was set: wait for what is left
            self.timer = self.loop.call_at(self.deadline, self._on_timer)
            return
        if self.paused:  # its answers unread all this while: a close would wait on them, so abort
            self.closed = True
            self.transport.abort()  # type: ignore[union-attr]
        elif self.buf or self.head is not None:  # a request that stopped halfway
            self._answer(400, error_answer("bad_request", "the request did not arrive within "
                                           f"{_REQUEST_TIMEOUT_S:.0f} s"), keep=False)
        else:
            self.closed = True
            self.transport.close()  # type: ignore[union-attr]


class ScoreHttpServer:
    """The scoring API on ``bind`` (``HOST:PORT``); see the module docstring."""

    def __init__(self, scorer: Scorer, bind: str, *, tokens: Sequence[str] = (), max_body: int = DEFAULT_MAX_BODY,
                 metrics: Any = None, loras: dict[str, str] | None = None, tls: ssl.SSLContext | None = None) -> None:
        """``tls``: serve HTTPS with this context (:func:`tls_context`); one that requires client certificates
        admits only their holders, so it stands in for a token beyond loopback."""
        self.scorer = scorer
        self.loras = dict(loras or {})
        self.host, self.port = parse_bind(bind)
        self._tokens = [t.encode() for t in tokens if t]
        self._tls = tls
        client_certs = tls is not None and tls.verify_mode == ssl.CERT_REQUIRED
        if not self._tokens and not client_certs and not is_loopback(self.host):
            raise ConfigError(f"--score-bind {bind}: a scoring endpoint reachable from other hosts tells anyone "
                              "who asks which prompts are cached; give it a bearer token (--score-token-file) or "
                              "require TLS client certificates (--score-tls-client-ca)")
        self.max_body = max_body
        self.metrics = metrics
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self._connections: set[_Connection] = set()
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and serve in a thread; returns the base URL (``http://HOST:PORT``, the port as bound)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._serve(ready))
            except BaseException as e:  # a bind that failed: start() raises it
                failure.append(e)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name="remote-g2-score-http", daemon=True)
        self._thread.start()
        ready.wait(10)
        if failure:
            raise ConfigError(f"--score-bind {self.host}:{self.port}: {failure[0]}")
        return self.url

    async def _serve(self, ready: threading.Event) -> None:
        self._stopped = asyncio.Event()
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: _Connection(self, loop), self.host, self.port, ssl=self._tls,
                                          ssl_handshake_timeout=_REQUEST_TIMEOUT_S if self._tls else None)
        sock = server.sockets[0].getsockname()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{'https' if self._tls else 'http'}://{host}:{sock[1]}"
        ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
            for conn in list(self._connections):  # the connections still open: ended before the loop is
                if conn.transport is not None:
                    conn.transport.abort()
            await asyncio.sleep(0)  # their connection_lost callbacks

    def close(self) -> None:
        loop, stopped = self._loop, self._stopped
        if loop is not None and stopped is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stopped.set)
            except RuntimeError:  # the loop closed meanwhile
                pass
        if self._thread is not None:
            self._thread.join(10)
            self._thread = None

    def __enter__(self) -> ScoreHttpServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what a request asks -----------------------------------------------------------------------

    def _authorized(self, header: str) -> bool:
        if not self._tokens:
            return True
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given_b = given.strip().encode()
        ok = False
        for token in self._tokens:  # every one compared: the time says nothing about which matched
            ok |= hmac.compare_digest(given_b, token)
        return ok

    def _score(self, body: bytes | bytearray, path: str) -> bytes:
        try:
            if path == "/query":
                req, block_size = query_request(body, self.loras)
                return query_answer(self.scorer.score(req), block_size)
            return score_answer(self.scorer.score(request_from_json(body)))
        except CannotScore as e:
            raise _HttpError(_REASON_STATUS.get(e.reason, 422), e.reason, e.message) from None
        except StoreUnavailable as e:
            raise _HttpError(503, "store_unavailable", str(e)) from None

    def _observe(self, status: int, seconds: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.scores.labels(str(status)).inc()
        if status == 200:
            m.score_latency.observe(seconds)
