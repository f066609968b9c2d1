"""A small cache-aware request router for `vllm serve` instances, using remote-g2's scoring API.

    python examples/cache_aware_router.py --port 8000 --score-url http://127.0.0.1:7460 \\
        --instance vllm-a=http://10.0.0.5:8001 --instance vllm-b=http://10.0.0.6:8001 [--max-inflight 4]

Each instance is named by the ``worker_id`` its remote-g2 connector registers
(``kv_connector_extra_config.worker_id``), or, for a vLLM without the
connector, by the worker id ``serve --vllm-kv-events`` follows it under.
For each ``POST /v1/completions`` or ``/v1/chat/completions`` the router:

1. **Maps the model.** The client names a model as vLLM serves it: a
   ``--served-model-name`` or a LoRA adapter's name. The scorer matches
   the path the engine loaded, and a LoRA request's ``lora_name`` and
   ``lora_path``. Each instance's ``GET /v1/models`` says both: a base
   model's ``root`` is its path, an adapter's ``root`` is its path and its
   ``parent`` the base model's name. Asked with the client's own headers
   (so ``vllm serve --api-key`` is satisfied), kept for 30 s, asked again
   sooner for a model no instance listed.
2. **Tokenizes** the prompt with the instances' own tokenizer: ``POST
   /tokenize`` on a live instance that serves the model (the next one if it
   is down), with the client's headers, and for a chat request the chat
   template's inputs (``chat_template_kwargs``, ``tools``, ...). Its token
   ids are then the engine's. A completion whose prompt is already token
   ids skips this.
3. **Scores** them: ``POST /v1/score`` with the model's path, the LoRA
   adapter, the ids and the request's ``cache_salt`` (docs/scoring.md).
4. **Picks** the instance holding the longest cached prefix, if it has fewer
   than ``--max-inflight`` requests in flight here. Otherwise it picks the
   least loaded instance whose engine shares the best one's blocks (the same
   ``compat_key``), and sets the response header ``X-Remote-G2-Pull-From`` to
   the best instance. That instance's remote-g2 connector finds the prefix in
   the registry and reads it from the best instance's G2 instead of
   recomputing it. With no cached prefix anywhere, it picks the least loaded
   instance.
5. **Forwards** the request unchanged (its body, and its headers but the
   hop-by-hop ones) and relays the answer, streamed or not. ``X-Routed-To``
   and ``X-Route-Reason`` (``cache``, ``pull``, ``load`` or ``fallback``) say
   what was chosen and why; they are left off an instance's 401 and 403, so a
   client without a valid key learns nothing about what is cached.

Routing by cache is an optimisation, never a dependency. Whenever a step
above cannot give a score (no prompt it understands, no instance can
tokenize, the scorer is down or answers oddly, it lists the instances as
unscored or knows none of them), the router picks the least loaded instance
(reason ``fallback``), counts the reason under ``fallbacks`` in ``GET
/router/status`` and logs it. An instance that refuses the connection is
left for 5 s and the request sent to the next one (counted as
``instance_down``). When an instance fails in the middle of a streamed
answer, the router closes the client's connection without the stream's
last chunk: the client sees a cut-short body, never an error inside a 200.
``--policy round-robin`` ignores scores (and asks for none): the baseline to
compare against (``bench/vllm/bench_routing.py``).

One file on aiohttp (which vLLM installs): an example to read and adapt,
not a production proxy (no retries once a request has reached an instance,
no health checks, no TLS).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web
from multidict import CIMultiDict

log = logging.getLogger("cache_aware_router")

MAX_BODY = 16 << 20
ROUTES = ("/v1/completions", "/v1/chat/completions")
# RFC 9110 7.6.1: these describe one connection, not the request, so a proxy never passes them on
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-connection", "proxy-authenticate", "proxy-authorization",
                        "te", "trailer", "transfer-encoding", "upgrade"})
# the body's own framing: recomputed for the body sent on
BODY_FRAMING = frozenset({"content-length", "host"})
# a chat request's fields that change the prompt vLLM renders (TokenizeChatRequest's fields in vLLM 0.32)
CHAT_TOKENIZE_FIELDS = ("add_generation_prompt", "continue_final_message", "add_special_tokens", "chat_template",
                        "chat_template_kwargs", "media_io_kwargs", "mm_processor_kwargs", "tools")
DOWN_S = 5.0  # an instance that refused a connection is left this long
MODELS_TTL_S = 30.0  # an instance's /v1/models is asked again after this long
MODELS_RETRY_S = 2.0  # and no sooner than this for a model it did not list


class NoScore(Exception):
    """No usable score for this request: ``reason`` is the counter it is filed under."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(frozen=True)
class ScoreKey:
    """What the scorer needs to know the request's model: the path the engine loaded, and its LoRA adapter."""

    model: str
    lora_name: str | None = None
    lora_path: str | None = None


@dataclass
class InstanceModels:
    """One instance's ``/v1/models``: each served name (base or LoRA) -> its :class:`ScoreKey`."""

    keys: dict[str, ScoreKey] = field(default_factory=dict)
    fetched_at: float = float("-inf")  # when it was read (monotonic); -inf: never
    tried_at: float = float("-inf")  # when it was last asked, answered or not
    pending: asyncio.Future[None] | None = None  # the ask in progress


def models_from(listing: Any) -> dict[str, ScoreKey]:
    """Served name -> :class:`ScoreKey` from a ``/v1/models`` answer. vLLM 0.32 lists a base model as ``{"id":
    served name, "root": model path}`` and a LoRA adapter as ``{"id": lora name, "root": lora path, "parent":
    base model's served name}``; vLLM hashes an adapter's blocks with its name and path."""
    cards = [c for c in listing.get("data", []) if isinstance(c, dict) and isinstance(c.get("id"), str)]
    bases = {c["id"]: str(c.get("root") or c["id"]) for c in cards if not c.get("parent")}
    keys = {name: ScoreKey(root) for name, root in bases.items()}
    for c in cards:
        if c.get("parent"):
            keys[c["id"]] = ScoreKey(bases.get(str(c["parent"]), str(c["parent"])), c["id"], str(c.get("root") or ""))
    return keys


class Router:
    """The routing decision and the bookkeeping behind it (one event loop: no locks needed)."""

    def __init__(self, instances: dict[str, str], score_url: str, *, max_inflight: int, token: str | None = None,
                 timeout_s: float = 2.0, policy: str = "score") -> None:
        self.policy = policy
        self.instances = instances  # worker id -> base URL
        self.score_url = score_url.rstrip("/")
        self.max_inflight = max_inflight
        self.token = token
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.inflight: Counter[str] = Counter()
        self.decisions: Counter[str] = Counter()
        self.fallbacks: Counter[str] = Counter()  # routed by load without a score, by why
        self.errors: Counter[str] = Counter()  # answers an instance failed to give whole
        self.down_until: dict[str, float] = {}
        self.models = {w: InstanceModels() for w in instances}
        self._rr = 0
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made inside the running loop; bodies relayed as sent, never decompressed
            self._session = aiohttp.ClientSession(  # no cap on connections: each is a client's request
                connector=aiohttp.TCPConnector(limit=0), auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        return self._session

    def fallback(self, reason: str, detail: str) -> None:
        self.fallbacks[reason] += 1
        log.warning("routing by load (%s): %s", reason, detail)

    def mark_down(self, wid: str, e: Exception) -> None:
        """``wid`` refused a connection: leave it for :data:`DOWN_S` (tokenizing and routing skip it)."""
        if self.down_until.get(wid, 0.0) <= time.monotonic():
            log.warning("%s is down (%s): left for %.0f s", wid, e, DOWN_S)
        self.down_until[wid] = time.monotonic() + DOWN_S

    def live(self, among: list[str]) -> list[str]:
        """``among`` less the instances left for refusing a connection (all of them if every one is down)."""
        now = time.monotonic()
        up = [w for w in among if self.down_until.get(w, 0.0) <= now]
        return up or list(among)

    def by_load(self, among: list[str]) -> list[str]:
        n = len(self.instances)
        order = list(self.instances)
        return sorted(among, key=lambda w: (self.inflight[w], (order.index(w) - self._rr) % n))

    # -- the model: served name -> what the scorer matches --------------------------------------------------------

    async def _refresh_models(self, wid: str, headers: CIMultiDict[str], force: bool) -> None:
        """Ask ``wid``'s ``/v1/models`` if it is stale (or ``force``), once at a time; concurrent callers wait."""
        m, now = self.models[wid], time.monotonic()
        if (m.pending is None and (force or now - m.fetched_at > MODELS_TTL_S) and now - m.tried_at > MODELS_RETRY_S
                and self.down_until.get(wid, 0.0) <= now):
            m.tried_at = now
            m.pending = asyncio.ensure_future(self._fetch_models(wid, headers))
        if m.pending is not None:
            await asyncio.shield(m.pending)

    async def _fetch_models(self, wid: str, headers: CIMultiDict[str]) -> None:
        m = self.models[wid]
        try:
            async with self.session.get(self.instances[wid] + "/v1/models", headers=headers,
                                        timeout=self.timeout) as r:
                r.raise_for_status()
                m.keys, m.fetched_at = models_from(await r.json(content_type=None)), time.monotonic()
        except aiohttp.ClientConnectorError as e:
            self.mark_down(wid, e)
        except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError, TypeError) as e:
            log.info("%s: GET /v1/models: %s", wid, e or type(e).__name__)
        finally:
            m.pending = None

    async def serving(self, model: str, headers: CIMultiDict[str]) -> dict[str, ScoreKey]:
        """The instances that list ``model``, each with its :class:`ScoreKey`. None listed it (or none could be
        asked): every instance, with the model as the client named it (it may be the path)."""
        await asyncio.gather(*(self._refresh_models(w, headers, force=all(model not in m.keys for m in
                                                                          self.models.values()))
                               for w in self.instances))
        found = {w: m.keys[model] for w, m in self.models.items() if model in m.keys}
        return found or {w: ScoreKey(model) for w in self.instances}

    # -- tokens and scores -------------------------------------------------------------------------------------

    async def tokenize(self, path: str, body: dict[str, Any], among: list[str], headers: CIMultiDict[str]
                       ) -> list[int]:
        """The prompt's token ids as the engines see them, from the first live instance in ``among`` that answers."""
        prompt = body.get("prompt")
        if path == "/v1/completions":
            if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                return prompt
            if not isinstance(prompt, str):
                raise NoScore("no_prompt", "not one prompt (text or token ids): several prompts score nothing")
            ask = {"model": body.get("model"), "prompt": prompt}
            if "add_special_tokens" in body:
                ask["add_special_tokens"] = body["add_special_tokens"]
        else:
            if not isinstance(body.get("messages"), list):
                raise NoScore("no_prompt", "a chat request without a list of messages")
            ask = {"model": body.get("model"), "messages": body["messages"],
                   **{k: body[k] for k in CHAT_TOKENIZE_FIELDS if k in body}}
        errors = []
        for wid in self.by_load(self.live(among)):
            try:
                async with self.session.post(self.instances[wid] + "/tokenize", json=ask, headers=headers,
                                             timeout=self.timeout) as r:
                    if 400 <= r.status < 500:  # the request's fault (or its key's): no other instance will differ
                        raise NoScore("tokenize_refused", f"{wid}: /tokenize answered {r.status}")
                    r.raise_for_status()
                    tokens = (await r.json(content_type=None)).get("tokens")
                if isinstance(tokens, list) and tokens and all(isinstance(t, int) for t in tokens):
                    return tokens
                errors.append(f"{wid}: no token ids in its answer")
            except aiohttp.ClientConnectorError as e:
                self.mark_down(wid, e)
                errors.append(f"{wid}: {e}")
            except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, AttributeError) as e:
                errors.append(f"{wid}: {e or type(e).__name__}")
        raise NoScore("tokenize_failed", "; ".join(errors) or "no instance to ask")

    async def score(self, key: ScoreKey, tokens: list[int], salt: Any, workers: list[str]) -> dict[str, Any]:
        """The scorer's answer for ``workers``, checked for the fields routing reads (NoScore if it cannot be used)."""
        body: dict[str, Any] = {"model": key.model, "token_ids": tokens, "workers": workers}
        if key.lora_name:
            body |= {"lora_name": key.lora_name, "lora_path": key.lora_path}
        if isinstance(salt, str) and salt:
            body["cache_salt"] = salt
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        try:
            async with self.session.post(self.score_url + "/v1/score", json=body, headers=headers,
                                         timeout=self.timeout) as r:
                if r.status == 422:  # well formed, but no candidate can be scored exactly
                    raise NoScore("unscored", f"the scorer answered 422: {(await r.text())[:200]}")
                r.raise_for_status()
                answer = await r.json(content_type=None)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise NoScore("score_failed", str(e) or type(e).__name__) from e
        except ValueError as e:
            raise NoScore("score_bad_answer", f"not JSON: {e}") from e
        try:  # only what routing reads, so that an odd answer is a fallback rather than a dropped connection
            scored = [{"worker_id": str(w["worker_id"]), "matched_tokens": int(w["matched_tokens"]),
                       "compat_key": str(w["compat_key"]), "readable": bool(w.get("readable", True))}
                      for w in answer["workers"]]
            unscored = [str(u["worker_id"]) for u in answer.get("unscored") or []]
        except (KeyError, TypeError, ValueError) as e:
            raise NoScore("score_bad_answer", f"{type(e).__name__}: {e} in {str(answer)[:200]}") from e
        return {"workers": scored, "unscored": unscored}

    async def scores(self, path: str, body: dict[str, Any], keys: dict[str, ScoreKey], headers: CIMultiDict[str]
                     ) -> list[dict[str, Any]]:
        """The scores of the instances in ``keys`` (those serving the request's model), best first; NoScore when
        none can be had, or when none of them holds anything and some could not be scored (unknown, not zero)."""
        tokens = await self.tokenize(path, body, list(keys), headers)
        groups: dict[ScoreKey, list[str]] = {}
        for wid, key in keys.items():  # one call per model path and adapter (instances may load from other paths)
            groups.setdefault(key, []).append(wid)
        answers = await asyncio.gather(*(self.score(k, tokens, body.get("cache_salt"), ws)
                                         for k, ws in groups.items()), return_exceptions=True)
        scored: list[dict[str, Any]] = []
        unscored: list[str] = []
        for a in answers:
            if isinstance(a, BaseException) and not isinstance(a, NoScore):
                raise a
            if not isinstance(a, NoScore):
                scored += [w for w in a["workers"] if w["worker_id"] in keys]
                unscored += [w for w in a["unscored"] if w in keys]
        scored.sort(key=lambda w: -w["matched_tokens"])  # stable: each answer's own order breaks ties
        if scored and scored[0]["matched_tokens"] > 0:
            return scored  # a cached prefix is known: worth routing by, whatever the rest could not say
        if failed := [a for a in answers if isinstance(a, NoScore)]:
            raise failed[0]
        if unscored:
            raise NoScore("unscored", f"the scorer cannot score {', '.join(unscored)} for {body.get('model')!r}")
        if not scored:
            raise NoScore("not_scored", f"the scorer lists none of the instances for {body.get('model')!r} (asked "
                                        f"as {', '.join(sorted({k.model for k in groups}))})")
        return scored

    # -- the choice --------------------------------------------------------------------------------------------

    def choose(self, among: list[str], scored: list[dict[str, Any]] | None, reason: str = "load"
               ) -> tuple[str, str, str | None]:
        """(worker id, reason, pull-from worker id or None) among live ``among``; takes an in-flight slot on it."""
        live = self.live(among)
        if self.policy == "round-robin":
            choice = live[self._rr % len(live)]
            reason, pull = "round-robin", None
        else:
            choice, pull = self.by_load(live)[0], None
            best = scored[0] if scored and scored[0]["matched_tokens"] > 0 else None
            if best is not None and best["worker_id"] in live:
                if self.inflight[best["worker_id"]] < self.max_inflight:
                    choice, reason = best["worker_id"], "cache"
                else:
                    peers = [w["worker_id"] for w in scored if w["compat_key"] == best["compat_key"]
                             and w["worker_id"] != best["worker_id"] and w["worker_id"] in live
                             and self.inflight[w["worker_id"]] < self.max_inflight]
                    if peers and best["readable"]:
                        choice = min(peers, key=lambda w: self.inflight[w])
                        reason, pull = "pull", best["worker_id"]
        self._rr += 1
        self.inflight[choice] += 1
        self.decisions[reason] += 1
        return choice, reason, pull

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"instances": {w: {"url": u, "inflight": self.inflight[w],
                                  "down_for_s": round(max(0.0, self.down_until.get(w, 0.0) - now), 1),
                                  "models": sorted(self.models[w].keys)} for w, u in self.instances.items()},
                "decisions": dict(self.decisions), "fallbacks": dict(self.fallbacks),
                "errors": dict(self.errors),
                "max_inflight": self.max_inflight}


def forwarded(headers: Any) -> CIMultiDict[str]:
    """The request's or answer's headers to pass on: all but the hop-by-hop ones (and those its ``Connection``
    header names) and the framing of a body that is sent on afresh."""
    named = {t.strip().lower() for v in headers.getall("Connection", []) for t in v.split(",")}
    return CIMultiDict((k, v) for k, v in headers.items()
                       if k.lower() not in HOP_BY_HOP and k.lower() not in named and k.lower() not in BODY_FRAMING)


def _json_error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


async def handle_status(request: web.Request) -> web.Response:
    return web.json_response(request.app["router"].status())


async def handle_route(request: web.Request) -> web.StreamResponse:
    router: Router = request.app["router"]
    if (request.content_length or 0) > MAX_BODY:  # at once, rather than after reading up to the limit
        raise web.HTTPRequestEntityTooLarge(MAX_BODY, request.content_length or 0)
    raw = await request.read()  # a chunked body past MAX_BODY is answered 413 by aiohttp (client_max_size)
    headers = forwarded(request.headers)
    side = CIMultiDict((k, v) for k, v in headers.items()  # for the router's own calls: the client's credentials
                       if k.lower() not in ("content-type", "content-encoding", "accept-encoding", "accept"))
    among, scored, reason = list(router.instances), None, "load"
    if router.policy == "score":
        try:
            try:
                body = json.loads(raw)
            except ValueError as e:  # forwarded all the same: the instance answers it
                raise NoScore("no_prompt", f"the body is not JSON: {e}") from e
            if not isinstance(body, dict) or not isinstance(body.get("model"), str):
                raise NoScore("no_prompt", "the body is not a JSON object naming a model")
            keys = await router.serving(body["model"], side)
            among = list(keys)
            scored = await router.scores(request.path, body, keys, side)
        except NoScore as e:
            router.fallback(e.reason, str(e))
            reason = "fallback"
    tried: set[str] = set()
    while True:
        worker, why, pull = router.choose([w for w in among if w not in tried], scored, reason)
        tried.add(worker)
        try:
            return await forward(request, router, worker, raw, headers, why, pull)
        except aiohttp.ClientConnectorError as e:  # the request never reached it: safe to send elsewhere
            router.decisions[why] -= 1
            router.mark_down(worker, e)
            router.fallback("instance_down", f"{worker}: {e}")
            if len(tried) == len(among):
                return _json_error(502, f"no instance answered; the last, {worker}: {e}")
            reason, scored = "fallback", None


async def forward(request: web.Request, router: Router, worker: str, raw: bytes, headers: CIMultiDict[str],
                  reason: str, pull: str | None) -> web.StreamResponse:
    """Relay one request to ``worker``, and release the in-flight slot :meth:`Router.choose` took. The slot is
    released as soon as the instance's answer is read whole, before the client gets its last byte, so a client
    that asks ``/router/status`` right after its answer never sees its own request still counted. Raises
    ClientConnectorError when the instance could not be reached (nothing was sent)."""
    released, resp = False, None

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            router.inflight[worker] -= 1

    try:
        async with router.session.post(router.instances[worker] + request.raw_path, data=raw, headers=headers,
                                       skip_auto_headers=("Content-Type", "User-Agent", "Accept-Encoding")) as up:
            out = forwarded(up.headers)
            if up.status not in (401, 403):  # say nothing of the cache to a client the instance refused
                out["X-Routed-To"], out["X-Route-Reason"] = worker, reason
                if pull:
                    out["X-Remote-G2-Pull-From"] = pull
            if up.headers.get("Content-Length") is not None:
                data = await up.read()
                release()
                return web.Response(status=up.status, reason=up.reason, body=data, headers=out)
            resp = web.StreamResponse(status=up.status, reason=up.reason, headers=out)
            resp.enable_chunked_encoding()
            await resp.prepare(request)
            while chunk := await up.content.readany():
                await resp.write(chunk)
            release()
            await resp.write_eof()
            return resp
    except aiohttp.ClientConnectorError:
        raise
    except (aiohttp.ClientError, asyncio.TimeoutError, ConnectionError) as e:
        client_gone = request.transport is None or request.transport.is_closing()
        if resp is None and not client_gone:  # nothing sent yet: a plain error answer
            router.errors["instance_failed"] += 1
            log.warning("%s failed before its answer was whole: %s", worker, e or type(e).__name__)
            return _json_error(502, f"instance {worker}: {e or type(e).__name__}")
        if not client_gone:
            # the status line is out: the one honest way to end is without the stream's last chunk, closing the
            # connection, so the client's HTTP library reports a cut-short body (never an error inside a 200)
            router.errors["stream_aborted"] += 1
            log.warning("%s failed mid-stream (%s): the client's answer is cut short", worker, e or type(e).__name__)
        request.protocol.force_close()  # leaving the `async with` closes the instance's connection: vLLM aborts
        return resp if resp is not None else web.Response(status=499)
    finally:
        release()


@web.middleware
async def only_known_routes(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return _json_error(404, "GET /router/status; POST /v1/completions, /v1/chat/completions")


def make_app(router: Router) -> web.Application:
    app = web.Application(client_max_size=MAX_BODY, middlewares=[only_known_routes])
    app["router"] = router
    app.router.add_get("/router/status", handle_status)
    for path in ROUTES:
        app.router.add_post(path, handle_route)

    async def close_session(_app: web.Application) -> None:
        if router._session is not None:
            await router._session.close()
    app.on_cleanup.append(close_session)
    return app


async def serve(router: Router, host: str, port: int) -> None:
    # auto_decompress=False: a compressed body is forwarded as it came, with its Content-Encoding
    runner = web.AppRunner(make_app(router), access_log=None, auto_decompress=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"cache-aware router on http://{host}:{bound} for {', '.join(router.instances)}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


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
    router = Router(instances, a.score_url, max_inflight=a.max_inflight, token=token, policy=a.policy)
    try:
        asyncio.run(serve(router, a.host, a.port))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
