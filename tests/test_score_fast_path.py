"""The scoring API's fast path: a whole, plain request on a kept-alive authenticated connection is answered in
aiohttp's ``data_received`` (registry/scoring/connection.py), without waking aiohttp's handler task.

Real parts: the HTTP server on a loopback socket, raw client sockets. Each
request is sent twice: first on a connection of its own (its first request:
always aiohttp's path), then on a connection that has been answered once
(the fast path, where the request allows it). The two answers must be the
same: status, headers (but the date), body, and whether the connection stays
open.
"""

from __future__ import annotations

import json
import random
import socket
import time

import pytest

from remote_g2.protocol.messages import BlockEvent, Events, LayoutFingerprint, RegisterWorker
from remote_g2.registry import MemoryStore
from remote_g2.registry.scoring.http_server import ScoreHttpServer, ScoreLimits
from remote_g2.registry.scoring.scorer import Scorer
from remote_g2.identity.vllm_hashing import DEFAULT_SEED, VllmBlockHasher, scheme_name

_FP = LayoutFingerprint(model_id="tiny#w-1", dtype="bfloat16", tokens_per_block=16, kv_layout="HND", num_layers=2,
                        num_kv_heads=4, head_dim=64, tp_size=1, hash_scheme=scheme_name("sha256", DEFAULT_SEED))
_PRIMER = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"


@pytest.fixture(scope="module")
def prompt():
    rng = random.Random(5)
    return [rng.randrange(50_000) for _ in range(1000)]


def _server(prompt, **kw) -> ScoreHttpServer:
    store = MemoryStore(lease_ttl_ms=3_600_000)
    store.register_worker(RegisterWorker("a", "tcp://10.0.0.1:7000", _FP, 1))
    hashes = VllmBlockHasher("sha256", DEFAULT_SEED, 16).hashes(prompt)[:20]
    assert store.apply_events(Events("a", 1, 1, [BlockEvent("stored", hashes)])).status == "ok"
    return ScoreHttpServer(Scorer(store), "127.0.0.1:0", **kw)


def _connect(srv: ScoreHttpServer) -> socket.socket:
    host, port = srv.url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _read_answer(f) -> tuple[int, dict[str, str], bytes]:
    status = int(f.readline().split()[1])
    headers: dict[str, str] = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers, f.read(int(headers.get("content-length", 0)))


def _closed(s: socket.socket, wait_s: float = 0.3) -> bool:
    """The server closed the connection (and sent nothing more) within ``wait_s``."""
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True
    except socket.timeout:
        return False


def _ask(srv: ScoreHttpServer, request: bytes, *, primed: bool, headers: bytes = b""):
    """(status, headers but the date, JSON body, connection closed after) of ``request``, the first request on its
    connection, or after one answered ``GET /healthz`` (with ``headers`` in it, e.g. a token)."""
    with _connect(srv) as s:
        f = s.makefile("rb")
        if primed:
            s.sendall(_PRIMER.replace(b"\r\n\r\n", b"\r\n" + headers + b"\r\n") if headers else _PRIMER)
            assert _read_answer(f)[0] == 200
        s.sendall(request)
        status, head, body = _read_answer(f)
        head.pop("date")
        return status, head, json.loads(body), _closed(s)


def _requests(prompt) -> list[bytes]:
    def post(path: bytes, body: bytes, extra: bytes = b"") -> bytes:
        return b"POST %s HTTP/1.1\r\nHost: x\r\n%sContent-Length: %d\r\n\r\n%s" % (path, extra, len(body), body)

    ok = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    return [
        post(b"/v1/score", ok),
        post(b"/v1/score?x=1", ok),
        post(b"/query", json.dumps({"model_name": "tiny", "token_ids": prompt}).encode()),
        post(b"/v1/score", ok, b"Connection: close\r\n"),  # (aiohttp's path: the same answer, then closed)
        post(b"/v1/score", b'{"model": "tiny", "token_ids": [1.5]}'),
        post(b"/v1/score", b'{"model": "tiny", "token_ids": [1]'),
        post(b"/v1/score", json.dumps({"model": "tiny", "token_ids": [1] * 300_000}).encode()),  # over the limit
        post(b"/query", json.dumps({"model_name": "tiny", "token_ids": prompt, "block_size": 64}).encode()),
        post(b"/nowhere", ok),
        post(b"/healthz", b"{}"),
        b"GET /v1/score HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
        post(b"/v1/score", ok, b"Content-Encoding: gzip\r\n"),
        post(b"/v1/score", ok, b"Authorization: Bearer a\r\nAuthorization: Bearer b\r\n"),
    ]


def test_the_fast_path_answers_as_aiohttps_path_does(prompt):
    with _server(prompt) as srv:
        for request in _requests(prompt):
            slow = _ask(srv, request, primed=False)
            fast = _ask(srv, request, primed=True)
            assert fast == slow, request[:120]
            doc = slow[2]
            assert slow[0] != 200 or doc == {"ok": True} or doc.get("best") == "a" or "a" in doc["instances"], slow
        # the plain ones went the fast path (a Connection: close one does not: aiohttp closes it)
        assert srv.connection_counts()["answered_inline"] >= len(_requests(prompt)) - 2


def test_the_fast_path_keeps_authentication_per_connection(prompt):
    """A connection that authenticated once keeps it; one that did not gets 401 and is closed, as before."""
    with _server(prompt, tokens=["t0ken"]) as srv:
        request = _requests(prompt)[0]
        status, _, doc, closed = _ask(srv, request, primed=True, headers=b"Authorization: Bearer t0ken\r\n")
        assert status == 200 and doc["best"] == "a" and not closed
        with _connect(srv) as s:  # /healthz answered to a stranger closes its connection: nothing is fast
            s.sendall(_PRIMER + request)
            f = s.makefile("rb")
            assert _read_answer(f)[0] == 200 and _closed(s)
        assert srv.connection_counts()["answered_inline"] == 1


def test_pipelined_requests_keep_their_order_across_both_paths(prompt):
    ok = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    req = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s"
    expect = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n%s"
    with _server(prompt) as srv, _connect(srv) as s:
        f = s.makefile("rb")
        s.sendall(_PRIMER)
        assert _read_answer(f)[0] == 200
        s.sendall(req % (len(ok), ok) + expect % (len(ok), ok) + req % (3, b"[1]") + req % (len(ok), ok))
        got = [_read_answer(f) for _ in range(4)]
        assert [g[0] for g in got] == [200, 200, 400, 200]
        assert json.loads(got[0][2])["best"] == json.loads(got[1][2])["best"] == json.loads(got[3][2])["best"] == "a"
        # (a malformed request in the same read as good ones: aiohttp's parser refuses the read whole, one 400)
        s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nX-A: 1\nContent-Length: 34\r\n\r\n" + _PRIMER)
        assert _read_answer(f)[0] == 400
        assert _closed(s)  # the bare LF: refused, closed, and the smuggled /healthz never answered
        assert srv.connection_counts()["answered_inline"] >= 1  # the first; from the Expect one on, aiohttp's task


def test_a_body_in_pieces_waits_on_the_fast_path_and_a_late_one_is_refused(prompt):
    ok = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    head = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(ok)
    with _server(prompt, limits=ScoreLimits(request_timeout_s=0.5)) as srv, _connect(srv) as s:
        f = s.makefile("rb")
        s.sendall(_PRIMER)
        assert _read_answer(f)[0] == 200
        for _ in range(2):
            s.sendall(head)
            for i in range(0, len(ok), 1500):
                time.sleep(0.005)
                s.sendall(ok[i:i + 1500])
            status, _, body = _read_answer(f)
            assert status == 200 and json.loads(body)["best"] == "a"
        assert srv.connection_counts()["answered_inline"] == 2
        t0 = time.monotonic()
        s.sendall(head + ok[:100])  # and the rest never
        status, headers, body = _read_answer(f)
        assert status == 400 and "did not arrive within 0.5 s" in json.loads(body)["error"]["message"]
        assert headers["connection"] == "close" and 0.3 < time.monotonic() - t0 < 5 and _closed(s)


def test_a_body_past_the_read_buffer_goes_to_aiohttps_task(prompt):
    """A body larger than aiohttp's read buffer pauses reading until a reader takes it: the handler task."""
    rng = random.Random(9)
    long = json.dumps({"model": "tiny", "token_ids": prompt + [rng.randrange(50_000) for _ in range(65_536)]}).encode()
    assert len(long) > 256 << 10
    with _server(prompt) as srv, _connect(srv) as s:
        f = s.makefile("rb")
        s.sendall(_PRIMER)
        assert _read_answer(f)[0] == 200
        for _ in range(3):
            s.sendall(b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(long), long))
            status, _, body = _read_answer(f)
            assert status == 200 and json.loads(body)["workers"][0]["matched_tokens"] == 320


def test_requests_on_one_tls_connection_take_the_fast_path(prompt, tmp_path):
    """HTTPS with client certificates: the handshake authenticates the connection, and its requests from then on
    are answered by the fast path through the TLS transport."""
    import shutil
    import ssl
    import subprocess

    from remote_g2.registry.scoring.http_server import tls_context

    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make test certificates with")
    (tmp_path / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (["req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=ca"],
                 ["req", *ec, "-keyout", "s.key", "-out", "s.csr", "-subj", "/CN=s"],
                 ["x509", "-req", "-in", "s.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                  "-out", "s.pem",
                  "-days", "2", "-extfile", "san.ext"],
                 ["req", *ec, "-keyout", "c.key", "-out", "c.csr", "-subj", "/CN=c"],
                 ["x509", "-req", "-in", "c.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                  "-out", "c.pem",
                  "-days", "2"]):
        subprocess.run(["openssl", *args], cwd=tmp_path, check=True, capture_output=True, timeout=60)
    tls = tls_context(str(tmp_path / "s.pem"), str(tmp_path / "s.key"), str(tmp_path / "ca.pem"))
    ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
    ctx.load_cert_chain(str(tmp_path / "c.pem"), str(tmp_path / "c.key"))
    ok = json.dumps({"model": "tiny", "token_ids": prompt}).encode()
    request = b"POST /v1/score HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (len(ok), ok)
    with _server(prompt, tls=tls) as srv:
        host, port = srv.url.removeprefix("https://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname=host) as s:
            f = s.makefile("rb")
            for _ in range(4):
                s.sendall(request)
                status, _, body = _read_answer(f)
                assert status == 200 and json.loads(body)["workers"][0]["matched_blocks"] == 20
        assert srv.connection_counts()["answered_inline"] == 4  # authenticated by its certificate at the handshake
