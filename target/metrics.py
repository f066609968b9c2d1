"""Prometheus metrics of a target client's leader (a private CollectorRegistry per client).

Names are ``remote_g2_target_*``. With ``TargetConfig.metrics_port`` the
leader serves them on that port (127.0.0.1 unless ``metrics_addr``).
"""

from __future__ import annotations

from prometheus_client import Counter, Histogram

from remote_g2.metrics_export import PrivateMetrics

__all__ = ["TargetMetrics", "PHASES"]

_LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_PHASE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 10.0)
#: The steps of a load, in order (``remote_g2_target_load_phase_seconds{phase}``).
PHASES = ("to_resolve", "resolve", "reads")


class TargetMetrics(PrivateMetrics):
    """What the target's leader counts: lookups by answer, loads by outcome, blocks, load latency."""

    def __init__(self) -> None:
        super().__init__()
        r = self.registry
        self.lookups = Counter("remote_g2_target_lookups", "Registry lookups by answer (ok, no_candidate, "
                               "source_is_target, incompatible_layout, registry_error, ...)", ["reason"], registry=r)
        self.mirror_lookups = Counter("remote_g2_target_mirror_lookups",
                                      "Lookups answered by the in-process registry mirror (no round trip)",
                                      registry=r)
        self.matched_blocks = Counter("remote_g2_target_matched_blocks", "Blocks remote sources offered at lookup",
                                      registry=r)
        self.loads = Counter("remote_g2_target_loads", "Loads by outcome (done, failed)", ["outcome"], registry=r)
        self.blocks_loaded = Counter("remote_g2_target_blocks_loaded", "Destination blocks loaded and valid",
                                     registry=r)
        self.blocks_invalid = Counter("remote_g2_target_blocks_invalid",
                                      "Destination blocks the engine must recompute (failed or missing)", registry=r)
        self.load_seconds = Histogram("remote_g2_target_load_seconds", "start_load to outcome, by outcome",
                                      ["outcome"], buckets=_LOAD_BUCKETS, registry=r)
        self.phase_seconds = Histogram(
            "remote_g2_target_load_phase_seconds",
            "Where a load's time goes: to_resolve (start_load until the resolve is sent: the coordinator's "
            "hand-off, and a lookup when the scheduler's answer was not cached), resolve (until the source "
            "answered: its pins on every rank), reads (from handing every rank its share until the last "
            "one reported)", ["phase"], buckets=_PHASE_BUCKETS, registry=r)

    def lookup(self, reason: str, matched: int) -> None:
        self.lookups.labels(reason.split(":", 1)[0][:40]).inc()  # "incompatible_layout: why" -> its kind
        if matched:
            self.matched_blocks.inc(matched)

    def phase(self, name: str, seconds: float) -> None:
        self.phase_seconds.labels(name).observe(max(0.0, seconds))

    def load(self, ok: bool, seconds: float, valid: int, invalid: int) -> None:
        outcome = "done" if ok else "failed"
        self.loads.labels(outcome).inc()
        self.load_seconds.labels(outcome).observe(seconds)
        self.blocks_loaded.inc(valid)
        self.blocks_invalid.inc(invalid)
