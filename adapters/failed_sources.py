"""Sources an engine should stop loading from for a while, because a load from them just failed.

A source that stalls or dies is still named by the registry until its lease
lapses (seconds to minutes). Without a memory of the failure, every new
request that matches its blocks waits out the transfer timeout (or the
resolve timeout) before recomputing. :class:`FailedSources` is that memory:
an engine notes a failed load's source and, for ``cooldown_s``, answers
matches naming it with "recompute" straight away. A later success does not
end the cooldown early (nothing is tried during it); it simply expires.

Not thread-safe: one scheduler loop owns it.
"""

from __future__ import annotations

import logging
import time

__all__ = ["FailedSources"]

log = logging.getLogger("remote_g2.adapters.failed_sources")


class FailedSources:
    """Source worker id -> until when (``time.monotonic()``) loads from it are not tried."""

    def __init__(self, cooldown_s: float = 30.0) -> None:
        if cooldown_s < 0:
            raise ValueError(f"cooldown_s must be >= 0, not {cooldown_s}")
        self.cooldown_s = cooldown_s
        self._until: dict[str, float] = {}

    def note_failure(self, worker_id: str, request_id: str = "", now: float | None = None) -> bool:
        """Start (or restart) ``worker_id``'s cooldown after ``request_id``'s load from it failed.

        True (and a warning in the log) if it was not cooling already.
        """
        now = time.monotonic() if now is None else now
        fresh = self.remaining(worker_id, now) == 0.0
        self._until[worker_id] = now + self.cooldown_s
        if fresh:
            log.warning("a load from %s failed (request %s): not loading from it for %g s", worker_id,
                        request_id or "?", self.cooldown_s)
        return fresh

    def remaining(self, worker_id: str, now: float | None = None) -> float:
        """Seconds of cooldown ``worker_id`` has left (0.0: loads from it may be tried)."""
        until = self._until.get(worker_id)
        if until is None:
            return 0.0
        now = time.monotonic() if now is None else now
        if now >= until:
            del self._until[worker_id]  # expired: forget it (the map stays as small as the failures)
            return 0.0
        return until - now
