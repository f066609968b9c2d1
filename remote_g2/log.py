"""Logging under the ``remote_g2`` logger, with a ``REMOTE_G2_LOG_LEVEL`` override.

Library code only calls ``logging.getLogger("remote_g2.<part>")``; handlers are
the application's business. Command-line entry points call
:func:`configure_logging` once.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterable

from remote_g2.errors import ConfigError

__all__ = ["configure_logging", "cpu_set_text", "LOG_LEVEL_ENV", "RateLimitedLog"]

LOG_LEVEL_ENV = "REMOTE_G2_LOG_LEVEL"
_FORMAT = "%(asctime)s %(levelname)-7s %(name)s: %(message)s"


def cpu_set_text(cpus: Iterable[int] | None = None) -> str:
    """``"0-3,8"``: a CPU set as ranges (default: the calling thread's affinity), for start-up logs.

    The services log it because their threads run on whatever CPUs the engine pinned its process to,
    and a service sharing a busy core stops answering (docs/operations.md, on-call step 8).
    """
    ids = sorted(set(os.sched_getaffinity(0) if cpus is None else cpus))
    runs: list[str] = []
    start = prev = None
    for c in [*ids, None]:
        if c is not None and prev is not None and c == prev + 1:
            prev = c
            continue
        if start is not None:
            runs.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = c
    return ",".join(runs) or "none"


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is *now* (tests and embedders swap it)."""

    def __init__(self) -> None:
        super().__init__()

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(level: str | None = None) -> int:
    """Attach a stderr handler to ``remote_g2`` at ``level`` (else the env var, else INFO).

    Returns the numeric level. An unknown level name is a :class:`ConfigError`
    rather than a silent fallback, so a typo in an operator's env is visible.
    """
    name = (level or os.environ.get(LOG_LEVEL_ENV) or "INFO").upper()
    numeric = logging.getLevelName(name)
    if not isinstance(numeric, int):
        raise ConfigError(f"unknown log level {name!r} (use DEBUG, INFO, WARNING, ERROR)")
    logger = logging.getLogger("remote_g2")
    logger.setLevel(numeric)
    if not any(getattr(h, "_remote_g2", False) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT))
        handler._remote_g2 = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
    return numeric


class RateLimitedLog:
    """Log a kind of event at most once per ``interval_s`` (per key), saying how many were held back.

    For what a client can make happen at will (malformed frames, refused
    calls): one line per interval tells the operator it is going on without
    letting a hostile client flood the log. Thread-safe.
    """

    def __init__(self, logger: logging.Logger, interval_s: float = 60.0) -> None:
        self._log = logger
        self._interval = interval_s
        self._next: dict[object, float] = {}   # key -> when its next line may be written
        self._held: dict[object, int] = {}     # key -> lines held back since its last one
        self._lock = threading.Lock()

    def log(self, level: int, key: object, msg: str, *args: object) -> bool:
        """Log ``msg % args`` unless ``key`` logged within the interval; True when it was written."""
        now = time.monotonic()
        with self._lock:
            if now < self._next.get(key, 0.0):
                self._held[key] = self._held.get(key, 0) + 1
                return False
            held = self._held.pop(key, 0)
            self._next[key] = now + self._interval
            if len(self._next) > 1024:  # keys are few in practice; never let them grow without bound
                self._next = {k: t for k, t in self._next.items() if t > now}
        if held:
            msg += f" (and {held} more like it in the last {self._interval:g} s)"
        self._log.log(level, msg, *args)
        return True

    def warning(self, key: object, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)
