"""A small cache-aware request router for `vllm serve` instances, using remote-g2's scoring API.

    python examples/cache_aware_router.py --port 8000 --score-url http://127.0.0.1:7460 \\
        --instance vllm-a=http://10.0.0.5:8001 --instance vllm-b=http://10.0.0.6:8001 [--max-inflight 4]

Each instance is named by the ``worker_id`` its remote-g2 connector registers
(``kv_connector_extra_config.worker_id``), or, for a vLLM without the
connector, by the worker id ``serve --vllm-kv-events`` follows it under.
For each ``POST /v1/completions`` or ``/v1/chat/completions`` the router:

1. **Tokenizes** the prompt with the instances' own tokenizer: ``POST /tokenize``
   on one of them, with the chat template for chat requests. Its token ids
   are then exactly the engine's. A completion whose prompt is already token
   ids skips this.
2. **Scores** them: ``POST /v1/score`` with the model, the ids and the
   request's ``cache_salt`` (docs/scoring.md).
3. **Picks** the instance holding the longest cached prefix, if it has fewer
   than ``--max-inflight`` requests in flight here. Otherwise it picks the
   least loaded instance whose engine shares the best one's blocks (the same
   ``compat_key``), and sets the response header ``X-Remote-G2-Pull-From`` to
   the best instance. That instance's remote-g2 connector finds the prefix in
   the registry and reads it from the best instance's G2 instead of
   recomputing it. With no cached prefix anywhere, it picks the least loaded
   instance.
4. **Forwards** the request unchanged and relays the answer, streamed or
   not. ``X-Routed-To`` and ``X-Route-Reason`` (``cache``, ``pull``, ``load``
   or ``fallback``) say what was chosen and why.

When the scoring API cannot answer (down, 4xx), the router falls back to the
least loaded instance: routing by cache is an optimisation, never a
dependency. ``--policy round-robin`` ignores scores (and asks for none): the
baseline to compare against (``bench/bench_routing.py``). ``GET /router/status`` shows each instance's in-flight count and
the router's decisions.

Standard library only, one thread per connection: an example to read and
adapt, not a production proxy (no retries or health checks, and no TLS).
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("cache_aware_router")

_MAX_BODY = 16 << 20


class Router:
    """The routing decision and the bookkeeping behind it (thread-safe)."""

    def __init__(self, instances: dict[str, str], score_url: str, *, max_inflight: int, token: str | None = None,
                 timeout_s: float = 2.0, policy: str = "score") -> None:
        self.policy = policy
        self.instances = instances  # worker id -> base URL
        self.score_url = score_url.rstrip("/")
        self.max_inflight = max_inflight
        self.token = token
        self.timeout_s = timeout_s
        self.inflight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._rr = 0

    def tokenize(self, path: str, body: dict[str, Any]) -> list[int] | None:
        """The prompt's token ids as the engines see them (None: no prompt this router understands)."""
        prompt = body.get("prompt")
        if path.endswith("/completions") and not path.endswith("/chat/completions"):
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                return None  # several prompts in one request: route without a score
            ask = {"model": body.get("model"), "prompt": prompt}
        else:
            if not isinstance(body.get("messages"), list):
                return None
            ask = {"model": body.get("model"), "messages": body["messages"], "add_generation_prompt": True}
        url = next(iter(self.instances.values())) + "/tokenize"
        return _post_json(url, ask, self.timeout_s).get("tokens")

    def score(self, model: str, tokens: list[int], salt: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"model": model, "token_ids": tokens, "workers": list(self.instances)}
        if salt:
            body["cache_salt"] = salt
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return _post_json(self.score_url + "/v1/score", body, self.timeout_s, headers)

    def choose(self, scores: dict[str, Any] | None) -> tuple[str, str, str | None]:
        """(worker id, reason, pull-from worker id or None); takes an in-flight slot on the chosen one."""
        with self._lock:
            if self.policy == "round-robin":
                choice = list(self.instances)[self._rr % len(self.instances)]
                self._rr += 1
                self.inflight[choice] += 1
                self.decisions["round-robin"] += 1
                return choice, "round-robin", None
            load = {w: self.inflight[w] for w in self.instances}
            least = min(self.instances, key=lambda w: (load[w], (list(self.instances).index(w) - self._rr)
                                                       % len(self.instances)))
            choice, reason, pull = least, "fallback" if scores is None else "load", None
            workers = [w for w in (scores or {}).get("workers", []) if w["worker_id"] in self.instances]
            best = workers[0] if workers and workers[0]["matched_tokens"] > 0 else None
            if best is not None:
                if load[best["worker_id"]] < self.max_inflight:
                    choice, reason = best["worker_id"], "cache"
                else:
                    peers = [w["worker_id"] for w in workers
                             if w["compat_key"] == best["compat_key"] and w["worker_id"] != best["worker_id"]
                             and load[w["worker_id"]] < self.max_inflight]
                    if peers and best.get("readable", True):
                        choice = min(peers, key=lambda w: load[w])
                        reason, pull = "pull", best["worker_id"]
            self._rr += 1
            self.inflight[choice] += 1
            self.decisions[reason] += 1
            return choice, reason, pull

    def done(self, worker_id: str) -> None:
        with self._lock:
            self.inflight[worker_id] -= 1

    def status(self) -> dict[str, Any]:
        with self._lock:
            return {"instances": {w: {"url": u, "inflight": self.inflight[w]} for w, u in self.instances.items()},
                    "decisions": dict(self.decisions), "max_inflight": self.max_inflight}


def _post_json(url: str, body: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.loads(r.read())


class Handler(BaseHTTPRequestHandler):
    router: Router
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: Any) -> None:  # one line per request, to the log, not stderr
        log.debug(fmt, *args)

    def do_GET(self) -> None:
        if self.path == "/router/status":
            self._reply(200, json.dumps(self.router.status()).encode())
        else:
            self._reply(404, b'{"error": "GET /router/status; POST /v1/completions, /v1/chat/completions"}')

    def do_POST(self) -> None:
        length_text = self.headers.get("Content-Length") or "0"
        length = int(length_text) if length_text.isascii() and length_text.isdigit() and len(length_text) < 12 else -1
        if not 0 < length <= _MAX_BODY or self.path not in ("/v1/completions", "/v1/chat/completions"):
            self._reply(400, b'{"error": "POST /v1/completions or /v1/chat/completions with a JSON body"}')
            return
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except ValueError:
            self._reply(400, b'{"error": "the body is not JSON"}')
            return
        scores = None
        try:
            tokens = self.router.tokenize(self.path, body) if self.router.policy == "score" else None
            if tokens and isinstance(body.get("model"), str):
                scores = self.router.score(body["model"], tokens, body.get("cache_salt"))
        except (urllib.error.URLError, OSError, ValueError) as e:  # the scorer is an optimisation
            log.warning("routing without a score: %s", getattr(e, "reason", e))
        worker, reason, pull = self.router.choose(scores)
        released = False

        def release() -> None:  # once: when the instance has answered, or the forward failed
            nonlocal released
            if not released:
                released = True
                self.router.done(worker)
        try:
            self._forward(worker, raw, reason, pull, release)
        finally:
            release()

    def _forward(self, worker: str, raw: bytes, reason: str, pull: str | None, release: Callable[[], None]) -> None:
        """Relay one request to ``worker``; ``release`` is called as soon as the instance's answer is read whole,
        before the client gets its last byte, so a client that asks ``/router/status`` right after its answer
        never sees its own request still counted in flight."""
        target = urlsplit(self.router.instances[worker])
        conn = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=600)
        try:
            conn.request("POST", self.path, raw, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            self.send_response(resp.status)
            for name, value in resp.getheaders():
                if name.lower() not in ("content-length", "transfer-encoding", "connection", "date", "server"):
                    self.send_header(name, value)
            self.send_header("X-Routed-To", worker)
            self.send_header("X-Route-Reason", reason)
            if pull:
                self.send_header("X-Remote-G2-Pull-From", pull)
            if resp.getheader("Content-Length") is not None:
                data = resp.read()
                release()
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            else:  # streamed (server-sent events): relay chunk by chunk
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                while chunk := resp.read1(65536):
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                release()
                self.wfile.write(b"0\r\n\r\n")
        except OSError as e:
            log.warning("%s: %s", worker, e)
            release()
            self._reply(502, json.dumps({"error": f"instance {worker}: {e}"}).encode())
        finally:
            conn.close()

    def _reply(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--score-url", required=True, help="remote-g2's scoring API (serve --score-bind)")
    p.add_argument("--score-token-file", help="its bearer token, if it needs one")
    p.add_argument("--instance", action="append", required=True, metavar="WORKER_ID=URL",
                   help="a vllm serve instance by its remote-g2 worker id; repeatable")
    p.add_argument("--policy", choices=("score", "round-robin"), default="score",
                   help="score: by remote-g2's scores (default); round-robin: the baseline, no scores")
    p.add_argument("--max-inflight", type=int, default=4,
                   help="requests in flight on an instance before the router sends its cached prefix elsewhere")
    a = p.parse_args(argv)
    instances = {}
    for text in a.instance:
        wid, sep, url = text.partition("=")
        if not sep or not wid or not url.startswith("http"):
            p.error(f"--instance {text!r}: expected WORKER_ID=http://HOST:PORT")
        instances[wid] = url.rstrip("/")
    token = None
    if a.score_token_file:
        with open(a.score_token_file, encoding="utf-8") as f:
            token = f.readline().strip()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    Handler.router = Router(instances, a.score_url, max_inflight=a.max_inflight, token=token, policy=a.policy)
    server = ThreadingHTTPServer((a.host, a.port), Handler)
    server.daemon_threads = True
    print(f"cache-aware router on http://{a.host}:{server.server_address[1]} for {', '.join(instances)}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
