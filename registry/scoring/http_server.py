"""The scoring API over HTTP/1.1 (``remote-g2 serve --score-bind``): routers ask, the :class:`~.scorer.Scorer` answers.

Routes (bodies are JSON, :mod:`.json_wire` reads and writes them; every
answer is JSON, errors included)::

    POST /v1/score   remote-g2's own shape            -> {"model", "num_tokens", "best", "workers", "unscored"}
    POST /query      Dynamo's and Mooncake's shape    -> {"scores", "instances"}
    GET  /healthz    -> {"ok": true}

Errors: ``{"error": {"reason", "message"}}`` with 400 (malformed: bad JSON,
bad UTF-8, wrong types, a malformed head), 401 (no or wrong bearer token),
404, 405, 411 (a chunked body), 413 (a body over ``max_body`` bytes, a
prompt over the scorer's limit), 422 (well-formed but not scorable exactly:
an unknown hash scheme, a seed not configured), 431 (a request line or
header line over 8 KiB, or over 64 headers), 500 (a bug: logged), 503 (the
store is unreachable, or every authenticated connection is busy).

The HTTP is aiohttp's (its low-level server and C parser; plain HTTP on
uvloop where installed): parsing, keep-alive, pipelining, writing with back-pressure and
TLS are that library's code; a plain request on an authenticated kept-alive
connection is answered without a task of its own (:mod:`.connection`). This module writes the routes and the rules
of who may ask; :mod:`.connection` the per-connection deadline and the TLS
hand-over; :mod:`.admission` the tokens and the connection budgets.

Who may ask: "is this prompt cached anywhere?" is a prompt-probing
attacker's question (docs/security.md), so a bind beyond loopback needs a
bearer token (``Authorization: Bearer <token>``; several tokens may be
valid at once, for rotation), compared in constant time, or TLS with client
certificates (:func:`tls_context` with a client CA). A request is
authenticated from its head alone, before any of its body is read (or,
with ``Expect: 100-continue``, sent): one without a valid token is answered
401 and its connection closed. ``GET /healthz`` needs no token and takes no
body (one that announces a body is refused unread); answered to a
connection that has not authenticated, it closes that connection.
Unauthenticated connections (TLS handshakes included) live in a small
budget of their own and can never take an authenticated one's place
(:mod:`.admission`).

One thread runs the event loop and scores each request on it: the work is
CPU-bound and short (a Redis store's lookup blocks the loop for its round
trip). Limits (:class:`ScoreLimits`): a new connection has 10 s to
handshake and send its first request; a request's head and body must
arrive within 10 s of its first byte; an idle kept-alive connection is
closed after 60 s, and so is a client that leaves its answers unread that
long (it is not read from meanwhile).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from aiohttp import HttpVersion10, HttpVersion11, web
from multidict import CIMultiDict

from remote_g2.errors import CannotScore, ConfigError, StoreUnavailable
from remote_g2.rpc.net_address import is_loopback

from .admission import Admission, BearerTokens
from .connection import ANSWER_HEADERS, RequestLate, ScoreConnection, TlsGate
from .json_wire import error_answer, query_answer, query_request, request_from_json, score_answer
from .scorer import Scorer

__all__ = ["ScoreHttpServer", "ScoreLimits", "parse_bind", "tls_context", "DEFAULT_MAX_BODY"]

log = logging.getLogger("remote_g2.registry.score")

DEFAULT_MAX_BODY = 4 << 20  # 4 MiB: a 262,144-token prompt as JSON is under 2 MiB
_SINGLE_HEADERS = ("Transfer-Encoding", "Authorization", "Expect")  # (Content-Length: the parser refuses two)
_REASON_STATUS = {"bad_request": 400, "too_large": 413, "unknown_scheme": 422, "seed_unknown": 422,
                  "unsupported_input": 422}
_ROUTES = ("/v1/score", "/query")
_OK = b'{"ok":true}'
_HEADERS_401 = CIMultiDict({**ANSWER_HEADERS, "WWW-Authenticate": 'Bearer realm="remote-g2"'})


@dataclass(frozen=True)
class ScoreLimits:
    """What one client may take of the server (docs/scoring.md, "Errors and limits")."""

    max_body: int = DEFAULT_MAX_BODY
    request_timeout_s: float = 10.0  # a new connection to its first answer; a request's first byte to its last
    idle_timeout_s: float = 60.0  # a kept-alive connection with nothing to say, or answers left unread
    max_authenticated: int = 512  # connections that presented a valid token (or needed none)
    max_unauthenticated: int = 64  # the rest: accepted, handshaking, or before their first request's head
    max_line: int = 8190  # the request line, and each header line (431 past it)
    max_headers: int = 64


class _Refusal(Exception):
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


class _AiohttpServer(web.Server):
    """aiohttp's low-level server, making :class:`ScoreConnection` handlers and telling the budgets of them."""

    def __init__(self, site: ScoreHttpServer, **kwargs: Any) -> None:
        super().__init__(site._handle, **kwargs)
        self.site = site

    def __call__(self) -> ScoreConnection:
        return ScoreConnection(self, loop=self._loop, **self._kwargs)

    def connection_made(self, handler: web.RequestHandler, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        handler.admit(transport)  # type: ignore[attr-defined]  # (a TLS connection: at its accept already)

    def connection_lost(self, handler: web.RequestHandler, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self.site.admission.release(handler)  # type: ignore[arg-type]


class ScoreHttpServer:
    """The scoring API on ``bind`` (``HOST:PORT``); see the module docstring."""

    def __init__(self, scorer: Scorer, bind: str, *, tokens: Sequence[str] = (), max_body: int = DEFAULT_MAX_BODY,
                 metrics: Any = None, loras: dict[str, str] | None = None, tls: ssl.SSLContext | None = None,
                 limits: ScoreLimits | None = None) -> None:
        """``tls``: serve HTTPS with this context (:func:`tls_context`); one that requires client certificates
        admits only their holders, so it stands in for a token beyond loopback. ``max_body`` is
        ``limits.max_body`` when ``limits`` is given."""
        self.scorer = scorer
        self.loras = dict(loras or {})
        self.host, self.port = parse_bind(bind)
        self.tokens = BearerTokens(tokens)
        self._tls = tls
        self._client_certs = tls is not None and tls.verify_mode == ssl.CERT_REQUIRED
        if not self.tokens.required and not self._client_certs and not is_loopback(self.host):
            raise ConfigError(f"--score-bind {bind}: a scoring endpoint reachable from other hosts tells anyone "
                              "who asks which prompts are cached; give it a bearer token (--score-token-file) or "
                              "require TLS client certificates (--score-tls-client-ca)")
        self.limits = limits or ScoreLimits(max_body=max_body)
        self.admission = Admission(self.limits.max_unauthenticated, self.limits.max_authenticated)
        self.metrics = metrics
        self.answered_inline = 0  # requests answered by the fast path (ScoreConnection.data_received)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopped: asyncio.Event | None = None
        self.url = ""

    # -- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> str:
        """Bind and serve in a thread; returns the base URL (``http://HOST:PORT``, the port as bound)."""
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = _new_loop(tls=self._tls is not None)
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
        lim = self.limits
        manager = _AiohttpServer(self, loop=loop, access_log=None, keepalive_timeout=lim.idle_timeout_s,
                                 max_line_size=lim.max_line, max_field_size=lim.max_line,
                                 max_headers=lim.max_headers, lingering_time=0, auto_decompress=False)
        tls = self._tls
        if tls is None:
            factory: Any = manager
        else:
            by_cert = self._client_certs and not self.tokens.required

            def factory() -> TlsGate:
                return TlsGate(manager, tls, by_cert)
        server = await loop.create_server(factory, self.host, self.port, backlog=1024)
        sock = server.sockets[0].getsockname()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{'https' if tls else 'http'}://{host}:{sock[1]}"
        ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
            for conn in self.admission.everyone():  # the connections still open: ended before the loop is
                conn.evict()
            for conn in manager.connections:
                if conn.transport is not None:
                    conn.transport.abort()
            await asyncio.sleep(0.01)  # their connection_lost callbacks

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

    def connection_counts(self) -> dict[str, int]:
        """Open connections by budget, and what the budgets did (for tests and operators; read on any thread:
        a snapshot, not exact under load)."""
        a = self.admission
        return {"unauthenticated": a.unauthenticated, "authenticated": a.authenticated,
                "evicted_unauthenticated": a.evicted_unauthenticated, "evicted_idle": a.evicted_idle,
                "refused": a.refused, "answered_inline": self.answered_inline}

    # -- a request -----------------------------------------------------------------------------------

    def authenticate(self, conn: ScoreConnection) -> bool:
        if not self.admission.authenticate(conn):
            return False
        conn.authenticated = True
        return True

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        conn: ScoreConnection = request.protocol  # type: ignore[assignment]
        started = time.perf_counter()
        conn.request_started()
        headers = ANSWER_HEADERS
        try:
            payload = await self._answer(request, conn)
            status, keep = 200, True
        except _Refusal as e:
            status, payload, keep = e.status, error_answer(e.reason, e.message), not e.close
            if status == 401:
                headers = _HEADERS_401
        except ConnectionError:
            raise  # the client went away: aiohttp ends the connection
        except Exception:  # a bug: this connection ends, the server keeps serving
            log.exception("score API: request failed")
            status, payload, keep = 500, error_answer("internal", "internal error (logged by the server)"), False
        conn.request_done()
        resp = web.Response(body=payload, status=status, headers=headers)
        if not keep or not conn.authenticated:  # a connection that never authenticated carries one answer
            resp.force_close()
        self._observe(status, time.perf_counter() - started)
        return resp

    async def _answer(self, request: web.BaseRequest, conn: ScoreConnection) -> bytes:
        """The answer's body; :class:`_Refusal` for every error. Everything up to the body's read looks at
        the head alone: a refused request's body is never read."""
        has_body = request.body_exists
        path = self.check_head(conn, request.method, request.raw_path, request.version, request.headers, has_body)
        if path == "/healthz":
            return _OK
        body = b""
        if has_body:
            content = request.content
            transport = request.transport
            if transport is not None and not content.is_eof() and \
                    request.headers.get("Expect", "").lower() == "100-continue":
                transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            if content.is_eof():  # the usual case: the whole body came with the head
                return self._score(content.read_nowait(), path)
            conn.body_stream = content
            try:
                body = await content.read()
            except RequestLate:
                raise _Refusal(400, "bad_request", "the request did not arrive within "
                               f"{self.limits.request_timeout_s:g} s", close=True) from None
            finally:
                conn.body_stream = None
        return self._score(body, path)

    def check_head(self, conn: ScoreConnection, method: str, raw_path: str, version: Any, headers: Any,
                   has_body: bool) -> str:
        """A request's head judged alone (version, framing, auth, route, method, length): its route's path,
        or :class:`_Refusal`. Authenticates ``conn`` by a valid token it carries."""
        if version != HttpVersion11 and version != HttpVersion10:
            raise _Refusal(400, "bad_request", f"unsupported protocol HTTP/{version[0]}.{version[1]}", close=True)
        for name in _SINGLE_HEADERS:  # two of them leave it in doubt how the body is framed, or who sent it
            if name in headers and len(headers.getall(name)) > 1:
                raise _Refusal(400, "bad_request", f"{name} given twice", close=True)
        path = raw_path.partition("?")[0]
        if not conn.authenticated:
            if self.tokens.accept(headers.get("Authorization")):
                if not self.authenticate(conn):
                    raise _Refusal(503, "busy", "every authenticated connection is busy: retry", close=True)
            elif path != "/healthz":
                raise _Refusal(401, "unauthorized", "a bearer token is required", close=True)
        else:
            self.admission.touch(conn)
        if path == "/healthz":
            if method != "GET":
                raise _Refusal(405, "bad_request", f"{method[:16]} {path}: use GET", close=has_body)
            if has_body:
                raise _Refusal(400, "bad_request", "GET /healthz takes no body", close=True)
            return path
        if path not in _ROUTES:
            raise _Refusal(404, "not_found", f"no route {path[:128]!r} (POST /v1/score, POST /query, GET /healthz)",
                           close=has_body)
        if method != "POST":
            raise _Refusal(405, "bad_request", f"{method[:16]} {path}: use POST", close=has_body)
        if "Transfer-Encoding" in headers:
            raise _Refusal(411, "bad_request", "chunked bodies are not accepted: send Content-Length", close=True)
        length = int(headers.get("Content-Length") or 0)  # (the parser has checked it: digits, once)
        if length > self.limits.max_body:
            raise _Refusal(413, "too_large", f"a body of {length} bytes (at most {self.limits.max_body})",
                           close=True)
        encoding = headers.get("Content-Encoding")
        if encoding is not None and encoding.lower() != "identity":
            raise _Refusal(415, "bad_request", "Content-Encoding is not accepted: send the JSON as it is",
                           close=True)
        return path

    def wants_body(self, conn: ScoreConnection, method: str, raw_path: str, version: Any, headers: Any) -> bool:
        """Whether :meth:`check_head` lets this head's body be read (a refused head's body is never waited for)."""
        try:
            return self.check_head(conn, method, raw_path, version, headers, True) != "/healthz"
        except _Refusal:
            return False

    def answer_inline(self, conn: ScoreConnection, method: str, raw_path: str, version: Any, headers: Any,
                      body: bytes) -> tuple[int, bytes, bool]:
        """A request whose head and body are both in (:meth:`ScoreConnection.data_received`'s fast path), answered
        without a task: ``(status, body, keep the connection)``. The same rules as :meth:`_handle`."""
        started = time.perf_counter()
        conn.request_started()
        try:
            path = self.check_head(conn, method, raw_path, version, headers, bool(body))
            payload = _OK if path == "/healthz" else self._score(body, path)
            status, keep = 200, True
        except _Refusal as e:
            status, payload, keep = e.status, error_answer(e.reason, e.message), not e.close
        except Exception:  # a bug: this connection ends, the server keeps serving
            log.exception("score API: request failed")
            status, payload, keep = 500, error_answer("internal", "internal error (logged by the server)"), False
        conn.request_done()
        self._observe(status, time.perf_counter() - started)
        return status, payload, keep

    def _score(self, body: bytes, path: str) -> bytes:
        try:
            if path == "/query":
                req, block_size = query_request(body, self.loras)
                return query_answer(self.scorer.score(req), block_size)
            return score_answer(self.scorer.score(request_from_json(body)))
        except CannotScore as e:
            raise _Refusal(_REASON_STATUS.get(e.reason, 422), e.reason, e.message) from None
        except StoreUnavailable as e:
            raise _Refusal(503, "store_unavailable", str(e)) from None

    def _observe(self, status: int, seconds: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.scores.labels(str(status)).inc()
        if status == 200:
            m.score_latency.observe(seconds)


def _new_loop(*, tls: bool) -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (it halves aiohttp's cost per request), asyncio's otherwise
    and for HTTPS: the TLS hand-over (:class:`~.connection.TlsGate`) pauses a new connection's reads from its
    ``connection_made`` until ``start_tls`` takes them, which asyncio honours and uvloop does not."""
    if tls:
        return asyncio.new_event_loop()
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
