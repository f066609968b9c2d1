"""A private Prometheus registry with an optional ``/metrics`` endpoint: the base of each part's metrics.

Every service keeps its own ``CollectorRegistry`` (two services in one
process must not share counters); subclasses create their metrics on
``self.registry``.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, start_http_server

__all__ = ["PrivateMetrics"]


class PrivateMetrics:
    """``registry`` to create metrics on; ``value`` for tests and stats; ``serve_http`` / ``close``."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._http: Any = None

    def value(self, name: str, labels: dict[str, str] | None = None) -> float:
        """One sample's current value (0 when absent)."""
        v = self.registry.get_sample_value(name, labels or {})
        return 0.0 if v is None else v

    def total(self, name: str, **match: str) -> float:
        """The sum of every sample of ``name`` whose labels include ``match`` (0 when none)."""
        return sum(sample.value for metric in self.registry.collect() for sample in metric.samples
                   if sample.name == name and all(sample.labels.get(k) == v for k, v in match.items()))

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> None:
        """Expose ``/metrics`` on ``addr:port`` from a daemon thread (port 0: any free port)."""
        self._http = start_http_server(port, addr=addr, registry=self.registry)

    def close(self) -> None:
        """Stop the endpoint, if serving; idempotent."""
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(2)
            self._http = None
