"""What the engine collects: finished request ids and the destination blocks to recompute, plus a wake-up fd.

Filled by whichever thread finishes a load (the leader's coordinator, or a
rank's loop for its own share), emptied by the engine's thread. The fd is
readable exactly while outcomes wait: :meth:`Outcomes.add` writes it under
the same lock that guards the sets, and :meth:`Outcomes.take` drains it there.
"""

from __future__ import annotations

import os
import select
import threading
from collections.abc import Iterable

__all__ = ["Outcomes"]

_MAX_ERRORS = 4096


class Outcomes:
    """Finished requests and invalid blocks since the engine last asked; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._invalid: set[int] = set()
        self._errors: dict[str, str] = {}  # failed request id -> why, until take_errors (bounded: _MAX_ERRORS)
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)

    @property
    def fd(self) -> int:
        """Readable while :meth:`take` has outcomes (-1 once closed)."""
        return self._r

    def add(self, request_id: str, ok: bool, invalid: Iterable[int] = (), error: str = "") -> None:
        """Record one request's outcome, the destination blocks the engine must recompute, and why it failed."""
        with self._lock:
            (self._done if ok else self._failed).add(request_id)
            self._invalid.update(invalid)
            if not ok and error:
                self._errors[request_id] = error
                while len(self._errors) > _MAX_ERRORS:  # an engine that never asks: keep the newest
                    del self._errors[next(iter(self._errors))]
            try:  # with the sets, under the lock: whoever wakes on the fd finds the outcome
                os.write(self._w, b"\0")
            except (BlockingIOError, OSError):  # full (it is readable anyway) or closed at shutdown
                pass

    def take(self) -> tuple[set[str], set[str]]:
        """``(done, failed)`` request ids since the last call; never blocks."""
        with self._lock:
            drain(self._r)
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def take_errors(self) -> dict[str, str]:
        """Why each failed request's load failed (the words of whatever failed), since the last call."""
        with self._lock:
            out, self._errors = self._errors, {}
        return out

    def take_invalid(self) -> set[int]:
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def wait(self, timeout_s: float) -> bool:
        """Block until :meth:`take` has outcomes, at most ``timeout_s``; True if it has."""
        readable, _, _ = select.select([self._r], [], [], max(0.0, timeout_s))
        return bool(readable)

    def close(self) -> None:
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1


def drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty (nothing to do for -1: not open, or closed)."""
    if fd < 0:
        return
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass
