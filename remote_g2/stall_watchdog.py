"""A stall watchdog for on-call debugging: dump every thread's stack when Python stops running here.

The failure it is for: a source (or target) inside an engine process stops
answering — resolves time out, heartbeats stop, the registry lapses the
worker — and then carries on as if nothing happened. From the outside that
looks like a network problem; from the inside it is a process in which no
Python thread ran for seconds (a C call holding the GIL, a starved CPU, a
stopped process). No Python-level monitor can report that, because it does
not run either.

:func:`maybe_start_stall_watchdog` (called by the source service and the
target client; a no-op unless ``REMOTE_G2_STALL_DUMP_S`` is set to a number
of seconds) arms :func:`faulthandler.dump_traceback_later`, whose timer runs
in a C thread that needs no GIL, and re-arms it every
``REMOTE_G2_STALL_DUMP_S / 4`` from a Python thread. When that thread could
not run for ``REMOTE_G2_STALL_DUMP_S``, the C thread writes every thread's
Python stack to stderr (the process keeps running) and keeps doing so every
period until Python runs again.

A process given no CPU at all (pinned to a core that other work saturates)
starves this C thread too: it dumps late, when the process runs again, or
not at all, and the stacks then show where each thread was when the CPU
went away. For that case the source logs the gap afterwards
(``this process did not run for N s``, from its lease reaper's late
wake-up; ``remote_g2_source_wakeup_lag_seconds``).

One per process (``faulthandler`` has one such timer): the first caller
starts it, later calls return the running one. Leave it off in production
unless chasing a stall; a process whose own code uses
``faulthandler.dump_traceback_later`` should not enable it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading

from remote_g2.errors import ConfigError

__all__ = ["STALL_DUMP_ENV", "StallWatchdog", "maybe_start_stall_watchdog"]

STALL_DUMP_ENV = "REMOTE_G2_STALL_DUMP_S"

log = logging.getLogger("remote_g2.stall")

_lock = threading.Lock()
_running: StallWatchdog | None = None


class StallWatchdog:
    """Re-arms a faulthandler timer of ``stall_s`` every ``stall_s / 4``; :meth:`stop` disarms it."""

    def __init__(self, stall_s: float) -> None:
        if not 0.1 <= stall_s <= 3600:
            raise ConfigError(f"{STALL_DUMP_ENV} must be between 0.1 and 3600 seconds, not {stall_s:g}")
        self.stall_s = stall_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="remote-g2-stall-watchdog", daemon=True)

    def start(self) -> StallWatchdog:
        self._arm()
        self._thread.start()
        log.info("stall watchdog on: every thread's stack goes to stderr when Python stalls for %g s",
                 self.stall_s)
        return self

    def stop(self) -> None:
        """Disarm; the next :func:`maybe_start_stall_watchdog` starts a new one."""
        global _running
        self._stop.set()
        self._thread.join(self.stall_s)
        faulthandler.cancel_dump_traceback_later()
        with _lock:
            if _running is self:
                _running = None

    def _arm(self) -> None:
        # repeat: while the stall lasts, a dump every period shows whether it moves
        faulthandler.dump_traceback_later(self.stall_s, repeat=True, file=_stderr(), exit=False)

    def _run(self) -> None:
        while not self._stop.wait(self.stall_s / 4):
            self._arm()  # re-arming restarts the countdown


def _stderr():  # noqa: ANN202
    """A stderr with a real file descriptor (the C thread writes to it; an embedder may have swapped ours)."""
    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, ValueError):
        return sys.__stderr__


def maybe_start_stall_watchdog() -> StallWatchdog | None:
    """Start this process's watchdog when ``REMOTE_G2_STALL_DUMP_S`` asks for one; None when it does not."""
    global _running
    raw = os.environ.get(STALL_DUMP_ENV, "").strip()
    if not raw:
        return None
    try:
        stall_s = float(raw)
    except ValueError:
        raise ConfigError(f"{STALL_DUMP_ENV}={raw!r} is not a number of seconds") from None
    with _lock:
        if _running is None:
            _running = StallWatchdog(stall_s).start()
        return _running
