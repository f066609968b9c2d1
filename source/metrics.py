"""Prometheus metrics of one source rank (a private CollectorRegistry per service).

Names are ``remote_g2_source_*``. Every rank keeps its own (pins, leases,
NIXL progress); the resolve metrics move on rank 0 only. With
``SourceConfig.metrics_port`` rank ``r`` serves them on ``port + r``.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from remote_g2.metric_children import LabelledChildren
from remote_g2.metrics_export import PrivateMetrics

__all__ = ["SourceMetrics", "RESOLVE_OUTCOMES"]

RESOLVE_OUTCOMES = ("ok", "miss", "over_budget", "error")
_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0)


# Scheduler noise is ~1 ms; a source that misses its timers by 0.5 s misses its readers' resolves too.
_LAG_BUCKETS = (0.001, 0.005, 0.02, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


class SourceMetrics(PrivateMetrics):
    """Counters, gauges and histograms one source rank updates."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        r = self.registry
        self.rank = rank
        self.blocks_pinned = Gauge("remote_g2_source_blocks_pinned",
                                   "Block pins held for remote leases on this rank", registry=r)
        self.leases_open = Gauge("remote_g2_source_leases_open", "Leases open on this rank", registry=r)
        self.leases_expired = Counter("remote_g2_source_leases_expired",
                                      "Leases ended by their TTL (the reader never released them)", registry=r)
        self.leases_released = Counter("remote_g2_source_leases_released", "Leases ended by release",
                                       registry=r)
        self.resolves = Counter("remote_g2_source_resolves", "Resolves by outcome (rank 0)", ["outcome"],
                                registry=r)
        self.resolve_latency = Histogram("remote_g2_source_resolve_seconds",
                                         "Server-side resolve latency, fan-out included (rank 0)",
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.matched_blocks = Counter("remote_g2_source_matched_blocks",
                                      "Blocks leased by successful resolves (rank 0)", registry=r)
        self.budget_available = Gauge("remote_g2_source_pin_budget_available",
                                      "Blocks remote leases may still pin (rank 0)", registry=r)
        self.sibling_failures = Counter("remote_g2_source_sibling_failures",
                                        "Sibling calls left unanswered: the rank hung, died or was starved "
                                        "(rank 0)", ["rank", "call"], registry=r)
        self.sibling_refusals = Counter("remote_g2_source_sibling_refusals",
                                        "Sibling calls answered ERR other than a malformed target frame "
                                        "(rank 0; the rank is alive)", ["rank", "call", "error"], registry=r)
        self.requests = Counter("remote_g2_source_requests", "Requests by message type and outcome",
                                ["type", "outcome"], registry=r)
        self.wakeup_lag = Histogram("remote_g2_source_wakeup_lag_seconds",
                                    "How late the lease reaper woke past its timer: time this process did not "
                                    "run (a starved CPU, a C call holding the GIL, a stopped process)",
                                    buckets=_LAG_BUCKETS, registry=r)
        self.progress_mode = Gauge("remote_g2_source_progress_mode",
                                   "1 for the progress mode this rank's NIXL agent runs in (event or poll)", ["mode"],
                                   registry=r)
        self.staging_in_use = Gauge("remote_g2_source_staging_bytes_in_use",
                                    "Bytes of this rank's staging region held by leases", registry=r)
        self.gathers = Counter("remote_g2_source_gathers",
                               "Target-rank parts of resolves that asked for a gather, by outcome (staged; "
                               "direct: few or large descriptors; no_room; lease_gone; unservable)",
                               ["outcome"], registry=r)
        self.gathered_bytes = Counter("remote_g2_source_gathered_bytes", "Bytes packed into staging",
                                      registry=r)
        self.gather_latency = Histogram("remote_g2_source_gather_seconds", "Time to pack one staged part",
                                        buckets=_LATENCY_BUCKETS, registry=r)
        self._outcome = {o: self.resolves.labels(o) for o in RESOLVE_OUTCOMES}
        self._request_children = LabelledChildren(self.requests)

    def resolve_outcome(self, outcome: str, seconds: float, matched: int = 0) -> None:
        self._outcome[outcome].inc()
        self.resolve_latency.observe(seconds)
        if matched:
            self.matched_blocks.inc(matched)

    def gather_outcome(self, outcome: str, nbytes: int, seconds: float) -> None:
        """:class:`~remote_g2.source.gather.Gatherer` observer hook."""
        self.gathers.labels(outcome).inc()
        if outcome == "staged":
            self.gathered_bytes.inc(nbytes)
            self.gather_latency.observe(seconds)

    def lease_table_changed(self, open_leases: int, pinned: int) -> None:
        """``LeaseTable`` on_change hook."""
        self.leases_open.set(open_leases)
        self.blocks_pinned.set(pinned)

    def observe_call(self, type_: str, seconds: float, outcome: str) -> None:
        """RPC observer hook (see :class:`remote_g2.rpc.server.RpcServer`)."""
        self._request_children(type_, outcome).inc()
