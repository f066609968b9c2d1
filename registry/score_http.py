"""The scoring API over HTTP/JSON (``remote-g2 serve --score-bind``): routers ask, the :class:`~.scoring.Scorer` answers.

Routes (bodies are JSON; every answer is JSON, errors included)::

    POST /v1/score   {"model", "token_ids" | "block_hashes", "lora_name", "lora_path",
                      "cache_salt", "workers"}  -> {"model", "num_tokens", "best", "workers": [...]}
    POST /query      Dynamo's standalone indexer and Mooncake's conductor shape:
                     {"model_name" | "model", "token_ids", "lora_name", "cache_salt",
                      "instance_id", "block_size"} -> {"scores", "instances"}
    GET  /healthz    -> {"ok": true}

``model_name`` is accepted for ``model`` (Dynamo's and llm-d's name for it);
``block_hashes`` are hex strings. ``/query`` answers in tokens, per
instance ``{"longest_matched", "gpu", "cpu", "disk", "dp"}`` with the tiers
cumulative as those routers read them (every match here is G2, host
memory: ``gpu`` 0, ``cpu`` = ``disk`` = the match) and ``scores`` (device
tokens per DP rank) alike; a LoRA adapter is named there without its path,
which vLLM hashes too, so ``/query`` needs ``--score-lora NAME=PATH``
(docs/scoring.md maps every field). Errors: ``{"error": {"reason", "message"}}``
with 400 (malformed: bad JSON, bad UTF-8, wrong types), 401 (no or wrong
bearer token), 404, 405, 411 (no Content-Length), 413 (a body over
``max_body`` bytes, a prompt over the scorer's limit), 422 (well-formed but
not scorable exactly: an unknown hash scheme, a seed not configured) and
503 (the store is unreachable). The connection is closed after any error
that leaves the stream in doubt; otherwise it is kept alive (HTTP/1.1).

Who may ask: "is this prompt cached anywhere?" is a prompt-probing
attacker's question (docs/security.md), so a bind beyond loopback needs a
bearer token (``Authorization: Bearer <token>``; several tokens may be
valid at once, for rotation), compared in constant time, or TLS with client
certificates (:func:`tls_context` with a client CA). HTTPS without client
certificates keeps a token from being read on the wire.

One thread runs an asyncio loop; each request is scored inline on it (the
work is CPU-bound and short; a Redis store's lookup blocks the loop for
its round trip). HTTP is parsed here, strictly and only as far as this API
needs: a request line, headers up to ``_MAX_HEAD`` bytes, a body of exactly
``Content-Length`` bytes (``Expect: 100-continue`` honoured; chunked
bodies refused with 411).
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

import msgspec

from remote_g2.errors import CannotScore, ConfigError, StoreUnavailable
from remote_g2.hashing import hash_from_hex
from remote_g2.net_address import is_loopback
from remote_g2.vllm_hashing import token_ids_from_json

from .scoring import ScoreReply, ScoreRequest, Scorer

__all__ = ["ScoreHttpServer", "parse_bind", "tls_context", "DEFAULT_MAX_BODY"]

log = logging.getLogger("remote_g2.registry.score")

DEFAULT_MAX_BODY = 4 << 20  # 4 MiB: a 262,144-token prompt as JSON is under 2 MiB
_MAX_HEAD = 16 << 10
_HEAD_TIMEOUT_S = 10.0  # a client that sends a request slowly is cut off (slow-loris)
_IDLE_TIMEOUT_S = 60.0  # a kept-alive connection with nothing to say
_MAX_CONNECTIONS = 512
_STATUS = {200: "OK", 100: "Continue", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
           405: "Method Not Allowed", 411: "Length Required", 413: "Content Too Large", 422: "Unprocessable Content",
           431: "Request Header Fields Too Large", 500: "Internal Server Error", 503: "Service Unavailable"}
_REASON_STATUS = {"bad_request": 400, "too_large": 413, "unknown_scheme": 422, "seed_unknown": 422,
                  "unsupported_input": 422}


class _Body(msgspec.Struct, forbid_unknown_fields=False):  # unknown fields are ignored, as Dynamo's indexer does
    model: str | None = None
    model_name: str | None = None
    token_ids: msgspec.Raw = msgspec.Raw()  # parsed in C++ (token_ids_from_json): no Python int per token
    block_hashes: list[str] | None = None
    lora_name: str | None = None
    lora_path: str | None = None
    cache_salt: str | None = None
    workers: list[str] | None = None
    instance_id: str | None = None  # /query: one instance (Mooncake)
    block_size: int | None = None   # /query: the caller's block size (Mooncake); checked, never assumed


_decoder = msgspec.json.Decoder(_Body)
_encoder = msgspec.json.Encoder()


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


def _decode(body: bytes) -> _Body:
    try:
        return _decoder.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError) as e:
        raise CannotScore(f"malformed request body: {e}", reason="bad_request") from None


def _model(b: _Body) -> str | None:
    """The request's model, named ``model`` or (Dynamo, llm-d) ``model_name``; both, they must agree."""
    if b.model and b.model_name and b.model != b.model_name:
        raise CannotScore("model and model_name differ", reason="bad_request")
    return b.model or b.model_name


def _token_ids(b: _Body) -> Any:
    raw = bytes(b.token_ids)
    return None if raw in (b"", b"null") else token_ids_from_json(raw)


def request_from_json(body: bytes) -> ScoreRequest:
    """A ``/v1/score`` body as a :class:`ScoreRequest`; :class:`CannotScore` (``bad_request``) if malformed."""
    b = _decode(body)
    hashes = None
    if b.block_hashes is not None:
        try:
            hashes = [hash_from_hex(h) for h in b.block_hashes]
        except ValueError as e:
            raise CannotScore(f"block_hashes: {e}", reason="bad_request") from None
    return ScoreRequest(model=_model(b), token_ids=_token_ids(b), block_hashes=hashes,
                        lora_name=b.lora_name, lora_path=b.lora_path, cache_salt=b.cache_salt, workers=b.workers)


def query_request(body: bytes, loras: dict[str, str]) -> tuple[ScoreRequest, int | None]:
    """A ``/query`` body (Dynamo / Mooncake) as a :class:`ScoreRequest` and the block size it states."""
    b = _decode(body)
    model = _model(b)
    token_ids = _token_ids(b)
    if token_ids is None or not model:
        raise CannotScore("/query needs token_ids and model_name", reason="bad_request")
    path = None
    if b.lora_name:
        path = b.lora_path or loras.get(b.lora_name)
        if path is None:
            raise CannotScore(f"LoRA adapter {b.lora_name!r}: vLLM hashes its path too, which this request does not "
                              "name; give it as lora_path, or to `remote-g2 serve --score-lora NAME=PATH`",
                              reason="unsupported_input")
    return ScoreRequest(model=model, token_ids=token_ids, lora_name=b.lora_name or None,
                        lora_path=path, cache_salt=b.cache_salt,
                        workers=None if b.instance_id is None else [b.instance_id]), b.block_size


def query_reply(reply: ScoreReply, block_size: int | None) -> dict[str, Any]:
    """The ``/query`` answer: per instance, tokens matched in each (cumulative) tier."""
    if block_size is not None and any(w.block_size != block_size for w in reply.workers):
        sizes = sorted({w.block_size for w in reply.workers})
        raise CannotScore(f"block_size {block_size}: the workers of this model use {sizes}", reason="unsupported_input")
    instances, scores = {}, {}
    for w in reply.workers:  # their tiers are cumulative: gpu <= cpu <= disk (a prefix held in any faster tier)
        bs = w.block_size
        gpu = w.tier.get("g1", 0) * bs
        cpu = max(gpu, w.tier.get("g2", 0) * bs)
        disk = max(cpu, w.matched_tokens)
        instances[w.worker_id] = {"longest_matched": w.matched_tokens, "gpu": gpu, "cpu": cpu, "disk": disk,
                                  "dp": {"0": gpu}}
        scores[w.worker_id] = {"0": gpu}
    return {"scores": scores, "instances": instances}


def reply_to_json(reply: ScoreReply) -> dict[str, Any]:
    return {"model": reply.model, "num_tokens": reply.num_tokens, "best": reply.best,
            "workers": reply.workers, "unscored": reply.unscored}  # msgspec encodes the Structs as they are


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
        self._tasks: set[asyncio.Task[None]] = set()
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
        server = await asyncio.start_server(self._connection, self.host, self.port, limit=_MAX_HEAD, ssl=self._tls,
                                            ssl_handshake_timeout=_HEAD_TIMEOUT_S if self._tls else None)
        sock = server.sockets[0].getsockname()
        host = f"[{self.host}]" if ":" in self.host else self.host
        self.url = f"{'https' if self._tls else 'http'}://{host}:{sock[1]}"
        ready.set()
        async with server:
            await self._stopped.wait()
            server.close()
            tasks = list(self._tasks)  # the connections still open: ended before the loop is
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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

    # -- HTTP --------------------------------------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if len(self._tasks) >= _MAX_CONNECTIONS or task is None:
            writer.close()
            return
        self._tasks.add(task)
        try:
            keep = True
            while keep:
                try:
                    async with asyncio.timeout(_IDLE_TIMEOUT_S):  # (no task per read, unlike wait_for)
                        head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.TimeoutError, ConnectionError):
                    return
                except asyncio.LimitOverrunError:
                    await self._send(writer, 431, _error("bad_request", f"request head over {_MAX_HEAD} bytes"),
                                     keep=False)
                    return
                t0 = time.perf_counter()
                try:
                    status, payload, keep = await self._request(head, reader, writer)
                except _HttpError as e:
                    status, payload, keep = e.status, _error(e.reason, e.message), not e.close
                await self._send(writer, status, payload, keep=keep)
                self._observe(status, time.perf_counter() - t0)
        except ConnectionError:
            pass
        except Exception:  # pragma: no cover - a bug: this connection ends, the server keeps serving
            log.exception("score API: connection failed")
        finally:
            self._tasks.discard(task)
            writer.close()

    async def _request(self, head: bytes, reader: asyncio.StreamReader,
                       writer: asyncio.StreamWriter) -> tuple[int, bytes, bool]:
        try:
            lines = head[:-4].decode("latin-1").split("\r\n")
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
            headers[name.lower()] = value.strip()
        conn = headers.get("connection", "").lower()
        keep = conn != "close" if version == "HTTP/1.1" else conn == "keep-alive"
        if "transfer-encoding" in headers:
            raise _HttpError(411, "bad_request", "chunked bodies are not accepted: send Content-Length", close=True)
        length_text = headers.get("content-length", "0")
        if not length_text.isdigit():
            raise _HttpError(400, "bad_request", "malformed Content-Length", close=True)
        length = int(length_text)
        if length > self.max_body:
            raise _HttpError(413, "too_large", f"a body of {length} bytes (at most {self.max_body})", close=True)
        path = target.split("?", 1)[0]
        if path != "/healthz" and not self._authorized(headers.get("authorization", "")):
            # refused before its body is read (or, with Expect: 100-continue, sent): the connection closes
            raise _HttpError(401, "unauthorized", "a bearer token is required", close=True)
        if length and headers.get("expect", "").lower() == "100-continue":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        try:
            body = b""
            if length:
                async with asyncio.timeout(_HEAD_TIMEOUT_S):
                    body = await reader.readexactly(length)
        except (asyncio.IncompleteReadError, asyncio.TimeoutError):
            raise _HttpError(400, "bad_request", "the body ended before Content-Length bytes", close=True) from None
        if path == "/healthz":
            if method != "GET":
                raise _HttpError(405, "bad_request", f"{method[:16]} {path}: use GET")
            return 200, b'{"ok":true}', keep
        if path not in ("/v1/score", "/query"):
            raise _HttpError(404, "not_found", f"no route {path[:128]!r} (POST /v1/score, POST /query, GET /healthz)")
        if method != "POST":
            raise _HttpError(405, "bad_request", f"{method[:16]} {path}: use POST")
        return 200, self._score(body, path), keep

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

    def _score(self, body: bytes, path: str) -> bytes:
        try:
            if path == "/query":
                req, block_size = query_request(body, self.loras)
                return _encoder.encode(query_reply(self.scorer.score(req), block_size))
            reply = self.scorer.score(request_from_json(body))
        except CannotScore as e:
            raise _HttpError(_REASON_STATUS.get(e.reason, 422), e.reason, e.message) from None
        except StoreUnavailable as e:
            raise _HttpError(503, "store_unavailable", str(e)) from None
        return _encoder.encode(reply_to_json(reply))

    async def _send(self, writer: asyncio.StreamWriter, status: int, payload: bytes, *, keep: bool) -> None:
        head = (f"HTTP/1.1 {status} {_STATUS.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(payload)}\r\n")
        if status == 401:
            head += 'WWW-Authenticate: Bearer realm="remote-g2"\r\n'
        head += "Connection: keep-alive\r\n\r\n" if keep else "Connection: close\r\n\r\n"
        writer.write(head.encode() + payload)
        try:
            await writer.drain()
        except ConnectionError:
            pass

    def _observe(self, status: int, seconds: float) -> None:
        m = self.metrics
        if m is None:
            return
        m.scores.labels(str(status)).inc()
        if status == 200:
            m.score_latency.observe(seconds)


def _error(reason: str, message: str) -> bytes:
    return _encoder.encode({"error": {"reason": reason, "message": message}})
