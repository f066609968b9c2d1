"""Cached children of labelled Prometheus metrics, for per-request paths."""

from __future__ import annotations

from typing import Any

__all__ = ["LabelledChildren"]


class LabelledChildren:
    """``children(*labels)`` is ``metric.labels(*labels)``, resolved once per label tuple.

    ``.labels()`` costs microseconds (argument checks, a lock, a dict lookup);
    on a request's path that adds up, and the label space here is small and fixed.
    """

    def __init__(self, metric: Any) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], Any] = {}

    def __call__(self, *labels: str) -> Any:
        child = self._children.get(labels)
        if child is None:
            child = self._children[labels] = self._metric.labels(*labels)
        return child
