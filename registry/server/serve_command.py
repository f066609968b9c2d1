"""``remote-g2 serve``: run a registry server until SIGINT/SIGTERM."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
from typing import Any

from remote_g2.rpc.curve import CurveServerConfig
from remote_g2.rpc.endpoint_list import endpoint_list
from remote_g2.errors import ConfigError
from remote_g2.rpc.net_address import is_wildcard, reachable_elsewhere, split_tcp
from remote_g2.rpc.server import free_port_on_host_of

from .service import DEFAULT_BIND, RegistryServer

log = logging.getLogger("remote_g2.registry")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--bind", default=DEFAULT_BIND, help=f"ZMQ endpoint to serve on (default {DEFAULT_BIND})")
    store = p.add_mutually_exclusive_group()
    store.add_argument("--redis-url", help="single-node Redis, e.g. redis://127.0.0.1:6379/0")
    store.add_argument("--redis-cluster-url", help="any node of a Redis Cluster, e.g. redis://10.0.0.1:7000")
    store.add_argument("--redis-sentinel", metavar="HOST:PORT[,...]/SERVICE",
                       help="single-node Redis whose master Redis Sentinel names: the sentinels and the service "
                            "name they monitor, e.g. 10.0.0.1:26379,10.0.0.2:26379/registry")
    p.add_argument("--lease-ttl-s", type=float, default=10.0, help="worker liveness lease (default 10 s)")
    p.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics on this port")
    p.add_argument("--metrics-addr", default="127.0.0.1", help="address for /metrics (default 127.0.0.1)")
    p.add_argument("--curve-secret-key", default=None, help="CURVE server key file (NAME.key_secret)")
    p.add_argument("--curve-allowed-clients", default=None, help="directory of client public keys to admit")
    p.add_argument("--workers", type=int, default=1,
                   help="serving threads: 1 (default) serves straight off the socket and batches queued lookups "
                        "into one Redis round trip; N>1 puts a pool of N threads behind a ZMQ proxy")
    p.add_argument("--feed-bind", default="auto",
                   help="ZMQ PUB endpoint of the change feed registry mirrors follow: 'auto' (default) = the "
                        "--bind host on a free port, 'none' = no feed")
    p.add_argument("--feed-advertise", default=None, metavar="tcp://HOST[:PORT]",
                   help="the feed endpoint mirrors are told, when it differs from the bound one (a NAT; port 0 or "
                        "none: the bound port). A feed bound to a wildcard needs none: mirrors dial it at the host "
                        "they reach this registry at")
    p.add_argument("--mirror-lookups", action="store_true",
                   help="(Redis stores) answer lookups from an in-process copy of the registry that follows the "
                        "change feeds, instead of a Redis script per lookup")
    p.add_argument("--mirror-peers", default="",
                   help="with --mirror-lookups: the other servers in front of the same store, "
                        "tcp://HOST:PORT[,...] (their feeds are followed too)")
    p.add_argument("--vllm-kv-events", default=None, metavar="[@|>]ENDPOINT=WORKER_ID[=MODEL][,...]",
                   help="follow vLLM workers' KV-event streams (vLLM: --kv-events-config, and "
                        "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0). ENDPOINT is connected to (vLLM binds: tcp://*:PORT "
                        "or ipc://) or, written @tcp://HOST:PORT, bound (vLLM connects: any other tcp:// endpoint). "
                        "A worker no source of its own registered is listed as events-only (MODEL names it) while "
                        "its stream is up")
    score = p.add_argument_group("scoring API for request routers (docs/scoring.md; off unless --score-bind)")
    score.add_argument("--score-bind", default=None, metavar="HOST:PORT",
                       help="serve POST /v1/score and /query over HTTP here; beyond loopback it needs a token")
    score.add_argument("--score-token-file", default=None, metavar="FILE",
                       help="bearer tokens the scoring API accepts, one per line (or $REMOTE_G2_SCORE_TOKEN)")
    score.add_argument("--score-tls-cert", default=None, metavar="FILE", help="serve HTTPS with this certificate")
    score.add_argument("--score-tls-key", default=None, metavar="FILE", help="its private key")
    score.add_argument("--score-tls-client-ca", default=None, metavar="FILE",
                       help="require client certificates signed by this CA (admits their holders without a token)")
    score.add_argument("--score-hash-seed", action="append", default=[], metavar="SEED",
                       help="a vLLM hash seed (the workers' PYTHONHASHSEED) a worker's hash scheme may name; "
                            "repeatable. vLLM's default seed is known; a seed is used only for the scheme whose "
                            "digest it matches")
    score.add_argument("--score-fetch-gbps", type=float, default=5.0,
                       help="remote-g2 read bandwidth assumed for fetch_ms (default 5 GB/s)")
    score.add_argument("--score-fetch-overhead-ms", type=float, default=3.0,
                       help="fixed cost of a remote load assumed for fetch_ms (default 3 ms)")
    score.add_argument("--score-prefill-ms-per-1k", action="append", default=[], metavar="[MODEL=]MS",
                       help="prefill time per 1,000 tokens, for prefill_saved_ms; repeatable per model label "
                            "(none: not estimated)")
    score.add_argument("--score-lora", action="append", default=[], metavar="NAME=PATH",
                       help="a LoRA adapter's path by name, for /query callers that send only lora_name; repeatable")
    p.add_argument("--vllm-all-media", action="store_true",
                   help="take vLLM events of every medium, not only the host (CPU) tier; needed for a CPU-backend "
                        "vLLM, which reports its cache as GPU")


def build_server(args: argparse.Namespace) -> RegistryServer:
    from ..stores.factory import open_store

    if args.lease_ttl_s <= 0:
        raise ConfigError("--lease-ttl-s must be positive")
    if args.curve_allowed_clients and not args.curve_secret_key:
        raise ConfigError("--curve-allowed-clients needs --curve-secret-key")
    curve = CurveServerConfig.from_files(args.curve_secret_key, args.curve_allowed_clients) \
        if args.curve_secret_key else None
    if args.mirror_lookups and not (args.redis_url or args.redis_cluster_url or args.redis_sentinel):
        raise ConfigError("--mirror-lookups is for Redis stores (the embedded store already answers from memory)")
    if args.mirror_lookups and args.feed_bind == "none":
        raise ConfigError("--mirror-lookups needs the change feed (drop --feed-bind none)")
    if args.mirror_peers and not args.mirror_lookups:
        raise ConfigError("--mirror-peers needs --mirror-lookups")
    store = open_store(redis_url=args.redis_url, redis_cluster_url=args.redis_cluster_url,
                       redis_sentinel=args.redis_sentinel, lease_ttl_ms=int(args.lease_ttl_s * 1000))
    feed_advertise = args.feed_advertise
    if feed_advertise and feed_advertise.count(":") == 1:  # tcp://HOST: the bound port
        feed_advertise += ":0"
    if feed_advertise and not reachable_elsewhere(feed_advertise):
        raise ConfigError(f"--feed-advertise {args.feed_advertise}: a wildcard or loopback address is no use to "
                          f"mirrors elsewhere; give this host's routable address")
    return RegistryServer(store, bind=args.bind, workers=args.workers, curve=curve,
                          feed_bind=feed_endpoint(args.bind, args.feed_bind), feed_advertise=feed_advertise,
                          mirror_lookups=args.mirror_lookups,
                          mirror_peers=endpoint_list(args.mirror_peers) if args.mirror_peers else [])


def feed_endpoint(bind: str, feed_bind: str) -> str | None:
    """``--feed-bind`` as an endpoint: ``auto`` = the bind's host on a free port; ``none`` = no feed."""
    if feed_bind == "none":
        return None
    if feed_bind != "auto":
        return feed_bind
    if not bind.startswith("tcp://"):
        raise ConfigError(f"--feed-bind auto needs a tcp:// --bind (got {bind!r}); give --feed-bind explicitly")
    return free_port_on_host_of(bind)


def build_score_api(args: argparse.Namespace, server: RegistryServer, *, follows_events: bool = False) -> Any:
    """The scoring API ``--score-*`` asks for (not started), or None without ``--score-bind``. With
    ``follows_events`` its scorer keeps the engines' own tiers (``.scorer.engines``, :mod:`.engine_caches`),
    which the KV-event subscriber fills."""
    import os

    from remote_g2.identity.vllm_hashing import DEFAULT_SEED

    from ..scoring.engine_caches import EngineCaches
    from ..scoring.http_server import ScoreHttpServer, tls_context
    from ..scoring.scorer import Scorer, ScoringConfig, parse_prefill_rates

    if args.score_bind is None:
        return None
    tokens: list[str] = []
    if args.score_token_file:
        try:
            with open(args.score_token_file, encoding="utf-8") as f:
                tokens = [line.strip() for line in f if line.strip()]
        except OSError as e:
            raise ConfigError(f"--score-token-file: {e}") from None
        if not tokens:
            raise ConfigError(f"--score-token-file {args.score_token_file}: no token in it")
    elif os.environ.get("REMOTE_G2_SCORE_TOKEN"):
        tokens = [os.environ["REMOTE_G2_SCORE_TOKEN"].strip()]
    if not args.score_fetch_gbps > 0 or not args.score_fetch_overhead_ms >= 0:
        raise ConfigError("--score-fetch-gbps must be positive and --score-fetch-overhead-ms not negative")
    loras = {}
    for text in args.score_lora:
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--score-lora {text!r}: expected NAME=PATH")
        loras[name] = path
    tls = None
    if args.score_tls_cert or args.score_tls_key or args.score_tls_client_ca:
        if not (args.score_tls_cert and args.score_tls_key):
            raise ConfigError("--score-tls-cert and --score-tls-key go together (and --score-tls-client-ca needs them)")
        tls = tls_context(args.score_tls_cert, args.score_tls_key, args.score_tls_client_ca)
    config = ScoringConfig(hash_seeds=tuple(dict.fromkeys([DEFAULT_SEED, *args.score_hash_seed])),
                           fetch_gbps=args.score_fetch_gbps, fetch_overhead_ms=args.score_fetch_overhead_ms,
                           prefill_ms_per_1k_tokens=parse_prefill_rates(args.score_prefill_ms_per_1k))
    engines = EngineCaches(config.hash_seeds) if follows_events else None
    return ScoreHttpServer(Scorer(server.store, config, mirror=server.mirror, engines=engines), args.score_bind,
                           tokens=tokens, metrics=server.metrics, loras=loras, tls=tls)


def run(args: argparse.Namespace) -> int:
    from ..scoring.vllm_events import VllmEventSubscriber
    from ..scoring.vllm_subscriptions import parse_subscriptions

    vllm_subscriptions = parse_subscriptions(args.vllm_kv_events) if args.vllm_kv_events is not None else None
    server = build_server(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    subscriber = None
    score_api = None
    try:
        endpoint = server.start()
        score_api = build_score_api(args, server, follows_events=bool(vllm_subscriptions))
        engines = score_api.scorer.engines if score_api is not None else None
        score = f", scoring API on {score_api.start()}" if score_api is not None else ""
        if args.metrics_port is not None:
            server.metrics.serve_http(args.metrics_port, args.metrics_addr)
        if vllm_subscriptions:
            subscriber = VllmEventSubscriber(server.store, vllm_subscriptions, all_media=args.vllm_all_media,
                                             metrics=server.metrics, on_applied=server.publish,
                                             engines=engines).start()
        metrics = f", metrics on http://{args.metrics_addr}:{args.metrics_port}/metrics" if args.metrics_port else ""
        feed = f", change feed on {server.feed_endpoint}" if server.feed is not None else ""
        if server.feed_endpoint.startswith("tcp://") and is_wildcard(split_tcp(server.feed_endpoint)[1]):
            feed += " (every interface: mirrors dial it at the host they reach this registry at)"
        elif server.feed is not None and not reachable_elsewhere(server.feed_endpoint) and \
                reachable_elsewhere(endpoint):
            feed += " (mirrors elsewhere cannot dial it: --feed-bind or --feed-advertise a routable address)"
        print(f"remote-g2 registry serving on {endpoint} (store: {server.store.name}{feed}{metrics}{score})",
              flush=True)
        while not stop.wait(0.5):
            pass
        log.info("shutting down")
    finally:
        if score_api is not None:
            score_api.close()
        if subscriber is not None:
            subscriber.close()
        server.close()
        server.store.close()
    return 0
