"""Prometheus metrics of a registry server (one CollectorRegistry per server).

Names are ``remote_g2_registry_*``. A private registry per server keeps two
servers in one process (tests, embedded use) from colliding; ``serve`` exposes
it over HTTP on ``--metrics-port``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from remote_g2.metric_children import LabelledChildren
from remote_g2.metrics_export import PrivateMetrics

__all__ = ["RegistryMetrics"]

# Lookups are sub-millisecond when healthy; the tail buckets catch a slow Redis.
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


class RegistryMetrics(PrivateMetrics):
    """Counters, gauges and histograms a registry server updates."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.requests = Counter("remote_g2_registry_requests", "Requests by message type and outcome",
                                ["type", "outcome"], registry=r)
        self.lookups = Counter("remote_g2_registry_lookups", "Prefix lookups served", registry=r)
        self.lookup_hits = Counter("remote_g2_registry_lookup_hits", "Lookups that found an owner", registry=r)
        self.lookup_reasons = Counter("remote_g2_registry_lookup_reasons", "Lookup outcomes by reason",
                                      ["reason"], registry=r)
        self.mirror_lookups = Counter("remote_g2_registry_mirror_lookups",
                                      "Lookups answered from the server's registry mirror (serve --mirror-lookups)",
                                      registry=r)
        self.matched_blocks = Counter("remote_g2_registry_matched_blocks", "Blocks matched by lookups", registry=r)
        self.lookup_latency = Histogram("remote_g2_registry_lookup_seconds", "Server-side lookup latency",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self.request_latency = Histogram("remote_g2_registry_request_seconds", "Server-side latency by type",
                                         ["type"], buckets=_LATENCY_BUCKETS, registry=r)
        self.events_ingested = Counter("remote_g2_registry_block_events", "Block events applied", ["source"],
                                       registry=r)
        self.resyncs = Counter("remote_g2_registry_resync_requests", "Event batches answered resync_needed",
                               registry=r)
        self.errors = Counter("remote_g2_registry_errors", "Errors by kind", ["kind"], registry=r)
        self.kv_events_refused = Counter("remote_g2_registry_kv_events_refused",
                                         "vLLM KV events refused one by one, the rest of their batch kept "
                                         "(serve --vllm-kv-events)", registry=r)
        self.endpoint_checks = Counter("remote_g2_registry_endpoint_checks",
                                       "Registrations whose endpoint other hosts may not dial, by verdict "
                                       "(refused: wildcard or loopback; flagged: loopback to a wildcard-bound registry)",
                                       ["verdict"], registry=r)
        self.workers_live = Gauge("remote_g2_registry_workers_live", "Workers with a live lease", registry=r)
        self.workers_total = Gauge("remote_g2_registry_workers_total", "Workers known (live or not yet swept)",
                                   registry=r)
        self.block_entries = Gauge("remote_g2_registry_block_entries", "(hash, worker) entries stored", registry=r)
        self.swept = Counter("remote_g2_registry_swept_incarnations", "Dead or superseded incarnations swept",
                             registry=r)
        self.scores = Counter("remote_g2_registry_scores", "Scoring API requests (serve --score-bind) by HTTP status",
                              ["status"], registry=r)
        self.score_latency = Histogram("remote_g2_registry_score_seconds",
                                       "Scoring API latency of answered requests, hashing and lookups included",
                                       buckets=_LATENCY_BUCKETS, registry=r)
        self._request_children = LabelledChildren(self.requests)
        self._latency_children = LabelledChildren(self.request_latency)
        self.lookup_reason = LabelledChildren(self.lookup_reasons)  # lookup_reason(reason).inc()

    def observe_call(self, type_: str, seconds: float, outcome: str) -> None:
        """RPC observer hook (see :class:`remote_g2.rpc.server.RpcServer`); on every request's path."""
        self._request_children(type_, outcome).inc()
        if outcome == "bad_request":
            self.errors.labels("bad_request").inc()
        elif type_ != "?":
            self._latency_children(type_).observe(seconds)
