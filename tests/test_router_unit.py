"""examples/cache_aware_router.py against small real HTTP servers: what it forwards, and how it fails.

The router runs as its own process, as a user runs it. In front of it,
plain HTTP clients and raw sockets; behind it, threads serving real sockets
in this process: two "instances" that answer as `vllm serve` 0.32 does
(``/v1/models``, ``/tokenize``, completions streamed or not, ``--api-key``)
and a scorer that answers as told (well, oddly, cut short). Each test
records what reached them. The cases with real vLLM are in
``tests/test_vllm_router.py``.
"""

from __future__ import annotations

import http.client
import json
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from conftest import free_port

ROUTER = Path(__file__).resolve().parents[1] / "examples" / "cache_aware_router.py"
KEY = "Bearer k-123"
TOKENS = list(range(100, 164))
MODELS = {"object": "list", "data": [  # as vLLM 0.32's /v1/models lists a served name and a LoRA adapter
    {"id": "tiny", "object": "model", "root": "/models/tiny", "parent": None},
    {"id": "sql", "object": "model", "root": "/loras/sql", "parent": "tiny"}]}


_RUNNING: list[Upstream] = []  # stopped after each test by the ``router`` fixture


@dataclass
class Seen:
    method: str
    path: str
    headers: http.client.HTTPMessage
    body: bytes


@dataclass
class Upstream:
    """A real HTTP server on a loopback port; ``routes[(method, path)](handler, body)`` writes each answer."""

    name: str
    routes: dict[tuple[str, str], Callable[[BaseHTTPRequestHandler, bytes], None]] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)

    def start(self) -> Upstream:
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def _any(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                upstream.seen.append(Seen(self.command, self.path, self.headers, body))
                route = upstream.routes.get((self.command, self.path.partition("?")[0]))
                if route is None:
                    reply(self, 404, {"error": "no such route"})
                else:
                    route(self, body)

            do_GET = do_POST = _any

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()
        _RUNNING.append(self)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def paths(self, prefix: str) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith(prefix)]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def reply(h: BaseHTTPRequestHandler, status: int, obj: Any, extra: dict[str, str] | None = None) -> None:
    data = json.dumps(obj).encode()
    h.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(data)), **(extra or {})}.items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(data)


def cut_short(h: BaseHTTPRequestHandler, status: int = 200) -> None:
    """Promise 100 bytes, send 10, close: an answer that ends early."""
    h.send_response(status)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", "100")
    h.end_headers()
    h.wfile.write(b'{"workers"')
    h.wfile.flush()
    h.close_connection = True
    h.connection.shutdown(socket.SHUT_RDWR)


def instance(name: str, *, api_key: str | None = KEY, die_mid_stream: list[str] | None = None) -> Upstream:
    """A `vllm serve` look-alike: auth like ``--api-key``, /v1/models, /tokenize, completions (streamed or not).
    ``die_mid_stream``: each streamed answer stops after its first chunk, the connection closed (``"close"``) or
    reset (``"reset"``), in turn."""
    up = Upstream(name)

    def authed(fn: Callable[[BaseHTTPRequestHandler, bytes], None]) -> Callable[[BaseHTTPRequestHandler, bytes], None]:
        def route(h: BaseHTTPRequestHandler, body: bytes) -> None:
            if api_key and h.headers.get("Authorization") != api_key:
                reply(h, 401, {"error": "Unauthorized"})
            else:
                fn(h, body)
        return route

    def complete(h: BaseHTTPRequestHandler, body: bytes) -> None:
        if not json.loads(body).get("stream"):
            reply(h, 200, {"instance": name}, {"X-Instance": name})
            return
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        for i in range(1 if die_mid_stream else 3):
            data = b'data: {"i": %d}\n\n' % i
            h.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            h.wfile.flush()
        if die_mid_stream:  # as an instance killed mid-answer: no last chunk, the connection closed or reset
            h.close_connection = True
            if die_mid_stream.pop(0) == "reset":
                time.sleep(0.2)  # the first chunk reaches the router before the reset
                h.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                h.rfile.close()
                h.wfile.close()
                h.connection.close()  # the last reference: an RST now, no FIN first
            else:
                h.connection.shutdown(socket.SHUT_RDWR)
            return
        h.wfile.write(b"0\r\n\r\n")

    up.routes = {("GET", "/v1/models"): authed(lambda h, b: reply(h, 200, MODELS)),
                 ("POST", "/tokenize"): authed(lambda h, b: reply(h, 200, {"tokens": TOKENS, "count": len(TOKENS)})),
                 ("POST", "/v1/completions"): authed(complete), ("POST", "/v1/chat/completions"): authed(complete)}
    return up.start()


def scorer(answer: Callable[[dict[str, Any]], Any] | None = None) -> Upstream:
    """A scoring API that answers ``answer(request)`` (default: every asked worker scored, nothing matched)."""
    up = Upstream("scorer")

    def score(h: BaseHTTPRequestHandler, body: bytes) -> None:
        ask = json.loads(body)
        out = answer(ask) if answer else {"workers": [{"worker_id": w, "matched_tokens": 0, "compat_key": "c"}
                                                      for w in ask["workers"]], "unscored": []}
        if callable(out):
            out(h)
        elif isinstance(out, tuple):
            reply(h, *out)
        else:
            reply(h, 200, out)

    up.routes = {("POST", "/v1/score"): score}
    return up.start()


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path

    def status(self) -> dict[str, Any]:
        return json.loads(request(self.port, "GET", "/router/status")[2])

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Callable[..., Router]]:
    started: list[Router] = []

    def start(instances: dict[str, str], score: Upstream, *args: str) -> Router:
        port, log = free_port(), tmp_path / f"router-{len(started)}.log"
        argv = [sys.executable, str(ROUTER), "--port", str(port), "--score-url", score.url, *args]
        for wid, url in instances.items():
            argv += ["--instance", f"{wid}={url}"]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        r = Router(proc, port, log)
        started.append(r)
        deadline = time.monotonic() + 30
        while True:
            try:
                r.status()
                return r
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, r.log_text()
                time.sleep(0.05)

    yield start
    for r in started:
        r.proc.terminate()
        try:
            r.proc.wait(10)
        except subprocess.TimeoutExpired:
            r.proc.kill()
            r.proc.wait(10)
    while _RUNNING:
        _RUNNING.pop().stop()


def request(port: int, method: str, path: str, body: bytes | dict[str, Any] | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, http.client.HTTPMessage, bytes]:
    """One request on a fresh connection: (status, headers, body)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, {"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.headers, resp.read()
    finally:
        conn.close()


def raw_exchange(port: int, data: bytes, idle_s: float = 1.0) -> bytes:
    """Send ``data`` on one connection; everything the router sends back until it closes or is idle ``idle_s``."""
    with socket.create_connection(("127.0.0.1", port), timeout=idle_s) as s:
        s.sendall(data)
        got = b""
        try:
            while chunk := s.recv(65536):
                got += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def test_a_request_reaches_the_instance_as_it_was_sent_with_its_key(router: Callable[..., Router]) -> None:
    a, b, score = instance("a"), instance("b"), scorer()
    r = router({"a": a.url, "b": b.url}, score)
    raw = b'{"model": "tiny",   "prompt": "hello there", "max_tokens": 2, "x_extra": [1, 2]}'
    status, head, body = request(r.port, "POST", "/v1/completions?trace=1", raw, {
        "Authorization": KEY, "X-Tenant": "t-7", "Connection": "keep-alive, X-Hop", "X-Hop": "drop me"})
    assert status == 200, body
    assert head["X-Instance"] == json.loads(body)["instance"] and head["X-Route-Reason"] == "load"
    sent = (a.paths("/v1/completions") + b.paths("/v1/completions"))
    assert len(sent) == 1 and sent[0].body == raw and sent[0].path == "/v1/completions?trace=1"
    assert sent[0].headers["Authorization"] == KEY and sent[0].headers["X-Tenant"] == "t-7"
    assert sent[0].headers["Content-Type"] == "application/json"
    assert sent[0].headers["X-Hop"] is None and "keep-alive" not in (sent[0].headers["Connection"] or "")
    # the router's own calls carry the client's key too: the model map and the tokens came back, so it scored
    assert all(s.headers["Authorization"] == KEY for u in (a, b) for s in u.paths("/tokenize") + u.paths("/v1/models"))
    assert len(score.paths("/v1/score")) == 1
    # without the key: the instance's 401 comes back as it was, and nothing is said about the cache
    status, head, body = request(r.port, "POST", "/v1/completions", {"model": "tiny", "prompt": "hi"})
    assert status == 401 and head["X-Route-Reason"] is None and head["X-Routed-To"] is None
    assert r.status()["fallbacks"] == {"tokenize_refused": 1}


def test_served_names_and_lora_adapters_are_scored_as_the_engine_loaded_them(router: Callable[..., Router]) -> None:
    def holds_on_b(ask: dict[str, Any]) -> dict[str, Any]:  # only the engine's own path and adapter match
        match = 128 if ask["model"] == "/models/tiny" else 0
        return {"workers": [{"worker_id": "b", "matched_tokens": match, "compat_key": "c"},
                            {"worker_id": "a", "matched_tokens": 0, "compat_key": "c"}], "unscored": []}
    a, b, score = instance("a"), instance("b"), scorer(holds_on_b)
    r = router({"a": a.url, "b": b.url}, score)
    status, head, _ = request(r.port, "POST", "/v1/completions", {"model": "tiny", "prompt": TOKENS},
                              {"Authorization": KEY})
    assert status == 200 and (head["X-Routed-To"], head["X-Route-Reason"]) == ("b", "cache")
    asked = json.loads(score.seen[-1].body)
    assert asked["model"] == "/models/tiny" and "lora_name" not in asked and asked["token_ids"] == TOKENS
    status, head, _ = request(r.port, "POST", "/v1/completions", {"model": "sql", "prompt": TOKENS},
                              {"Authorization": KEY})
    assert status == 200 and head["X-Route-Reason"] == "cache"
    asked = json.loads(score.seen[-1].body)
    assert (asked["model"], asked["lora_name"], asked["lora_path"]) == ("/models/tiny", "sql", "/loras/sql")
    assert sorted(r.status()["instances"]["a"]["models"]) == ["sql", "tiny"]


def test_an_unscored_or_unmatched_answer_routes_by_load_and_says_why(router: Callable[..., Router]) -> None:
    answers: list[Any] = [
        {"workers": [], "unscored": [{"worker_id": w, "reason": "lora", "message": "LoRA"} for w in ("a", "b")]},
        (422, {"error": {"reason": "unsupported_input", "message": "no candidate can be scored"}}),
        {"workers": [], "unscored": []}]
    a, b, score = instance("a"), instance("b"), scorer(lambda ask: answers.pop(0))
    r = router({"a": a.url, "b": b.url}, score)
    for _ in range(3):
        status, head, _ = request(r.port, "POST", "/v1/completions", {"model": "sql", "prompt": TOKENS},
                                  {"Authorization": KEY})
        assert status == 200 and head["X-Route-Reason"] == "fallback"
    st = r.status()
    assert st["fallbacks"] == {"unscored": 2, "not_scored": 1} and st["decisions"] == {"fallback": 3}
    text = r.log_text()
    assert "routing by load (unscored)" in text and "routing by load (not_scored)" in text


def test_tokens_come_from_any_live_instance_and_a_dead_one_is_skipped(router: Callable[..., Router]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    b, score = instance("b"), scorer()
    r = router({"a": dead, "b": b.url}, score)
    status, head, _ = request(r.port, "POST", "/v1/completions", {"model": "tiny", "prompt": "some text"},
                              {"Authorization": KEY})
    assert status == 200 and (head["X-Routed-To"], head["X-Route-Reason"]) == ("b", "load")
    assert json.loads(score.seen[-1].body)["token_ids"] == TOKENS and len(b.paths("/tokenize")) == 1
    st = r.status()
    assert st["instances"]["a"]["down_for_s"] > 0 and st.get("fallbacks", {}) == {}
    # without scores (round-robin), a request sent to the dead instance goes on to the live one
    rr = router({"a": dead, "b": b.url}, score, "--policy", "round-robin")
    for _ in range(2):
        status, head, _ = request(rr.port, "POST", "/v1/completions", {"model": "tiny", "prompt": "x"},
                                  {"Authorization": KEY})
        assert status == 200 and head["X-Routed-To"] == "b"
    assert rr.status()["fallbacks"] == {"instance_down": 1} and "a is down" in rr.log_text()


def test_a_chat_is_tokenized_with_its_template_inputs(router: Callable[..., Router]) -> None:
    a, score = instance("a"), scorer()
    r = router({"a": a.url}, score)
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "He"}],
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3}
    status, _, _ = request(r.port, "POST", "/v1/chat/completions", chat, {"Authorization": KEY})
    assert status == 200
    asked = json.loads(a.paths("/tokenize")[0].body)
    assert asked == {k: chat[k] for k in ("model", "messages", "chat_template_kwargs", "tools",
                                          "add_generation_prompt", "continue_final_message")}


def test_an_instance_failing_mid_stream_cuts_the_answer_short(router: Callable[..., Router]) -> None:
    a, score = instance("a", die_mid_stream=["reset", "close"]), scorer()
    r = router({"a": a.url}, score)
    body = json.dumps({"model": "tiny", "prompt": TOKENS, "stream": True}).encode()
    got = raw_exchange(r.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: %s\r\n"
                       b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (KEY.encode(), len(body), body),
                       idle_s=10)
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower()
    assert b'data: {"i": 0}' in rest and b"502" not in rest and b"HTTP/1.1" not in rest  # no error inside the 200
    assert not rest.endswith(b"0\r\n\r\n")  # the stream ends without its last chunk: the client sees it cut short
    # ... and the connection was closed (raw_exchange returned before its 10 s idle limit on the close)
    conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
    conn.request("POST", "/v1/completions", body, {"Authorization": KEY, "Content-Type": "application/json"})
    resp = conn.getresponse()
    with pytest.raises(http.client.IncompleteRead):
        resp.read()
    conn.close()
    assert r.status()["errors"] == {"stream_aborted": 2}


def test_a_refused_request_body_is_never_read_as_a_request(router: Callable[..., Router]) -> None:
    a, score = instance("a", api_key=None), scorer()
    r = router({"a": a.url}, score)
    smuggled = json.dumps({"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}).encode()
    smuggled = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(smuggled), smuggled))
    for head in (b"POST /v1/other HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(smuggled),  # bad path
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1x\r\n\r\n",  # bad length
                 b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (17 << 20)):  # too long
        got = raw_exchange(r.port, head + smuggled)
        assert got[:10] in (b"HTTP/1.1 4", b"HTTP/1.0 4") and got.count(b"HTTP/1.") == 1, got[:300]
        assert a.paths("/v1/completions") == [], head
    # a chunked body (which the old router refused, then read its chunks as requests) is forwarded whole
    body = json.dumps({"model": "tiny", "prompt": [5, 6, 7]}).encode()
    got = raw_exchange(r.port, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                       % (len(body), body), idle_s=10)
    assert got.startswith(b"HTTP/1.1 200") and [s.body for s in a.paths("/v1/completions")] == [body]


def test_an_odd_or_cut_short_answer_from_the_scorer_or_tokenizer_still_routes(router: Callable[..., Router]) -> None:
    answers: list[Any] = [{"workers": [{"worker_id": "a"}]}, [1, 2], "not an object", cut_short]
    a, b, score = instance("a"), instance("b"), scorer(lambda ask: answers.pop(0) if answers else {
        "workers": [{"worker_id": w, "matched_tokens": 0, "compat_key": "c"} for w in ask["workers"]]})
    r = router({"a": a.url, "b": b.url}, score)
    for _ in range(4):
        status, head, _ = request(r.port, "POST", "/v1/completions", {"model": "tiny", "prompt": TOKENS},
                                  {"Authorization": KEY})
        assert status == 200 and head["X-Route-Reason"] == "fallback"
    for up in (a, b):  # both tokenizers cut their answers short
        up.routes[("POST", "/tokenize")] = lambda h, body: cut_short(h)
    status, head, _ = request(r.port, "POST", "/v1/completions", {"model": "tiny", "prompt": "text"},
                              {"Authorization": KEY})
    assert status == 200 and head["X-Route-Reason"] == "fallback"
    # an instance whose (not streamed) answer ends early: a plain 502, and the router serves on
    a.routes[("POST", "/v1/completions")] = b.routes[("POST", "/v1/completions")] = lambda h, body: cut_short(h)
    status, _, body = request(r.port, "POST", "/v1/completions", {"model": "tiny", "prompt": TOKENS},
                              {"Authorization": KEY})
    assert status == 502 and b"instance" in body
    st = r.status()
    assert st["fallbacks"] == {"score_bad_answer": 3, "score_failed": 1, "tokenize_failed": 1}
    assert st["errors"] == {"instance_failed": 1}
