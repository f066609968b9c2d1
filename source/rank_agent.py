"""This rank's NIXL agent: the pool registered for remote READs, and the progress it needs.

The agent runs with neither NIXL's listen thread (metadata travels in the
RPCs) nor its progress thread (with no delay configured it spins a core;
docs/benchmarks.md, "One-off measurements"). But a reader's READs need the
source side's progress: always for the UCX wire-up (without it the reader's
transfer stays ``PROC`` and the connection is dropped), and for *every* READ
where the transport emulates it in software — UCX over TCP, the usual
fabric between cloud VMs — while over shared memory (``cma``) or RDMA a
connected reader's READs complete without us. So a small thread here drives
the agent by polling ``get_new_notifs()``: every ``busy_interval_s`` while
leases are open (a reader is connecting or reading), every
``idle_interval_s`` otherwise, and at once when :meth:`wake` says a lease
opened — a READ posted right after its resolve then never waits out an idle
sleep.

Only that thread touches the agent after start-up, and :meth:`close` stops
it before tearing the agent down, so the agent's thread-unsafe default sync
mode is fine. Teardown order: progress thread, memory deregistration, agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from remote_g2.secondary_pool import MemoryRegion
from remote_g2.errors import SourceError

__all__ = ["RankAgent", "agent_name_for"]

log = logging.getLogger("remote_g2.source.nixl")


def agent_name_for(worker_id: str, rank: int) -> str:
    """``remote-g2-source-{worker_id}-tp{rank}`` (DESIGN.md fixes the form)."""
    return f"remote-g2-source-{worker_id}-tp{rank}"


class RankAgent:
    """Create the agent, register ``regions``; ``start_progress()`` then ``close()``."""

    def __init__(self, name: str, regions: Sequence[MemoryRegion], *, busy: Callable[[], bool] = lambda: False,
                 busy_interval_s: float = 0.002, idle_interval_s: float = 0.02) -> None:
        if not regions:
            raise SourceError("the pool reports no memory regions to register")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise SourceError(f"NIXL is not importable ({e}); the source service needs it") from e
        self.name = name
        self._busy = busy
        self._busy_interval = busy_interval_s
        self._idle_interval = idle_interval_s
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._regs: list[Any] = []
        self._agent: Any = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                              backends=["UCX"]))
        try:
            if "UCX" not in self._agent.backends:
                raise SourceError(f"NIXL agent {name}: the UCX backend is not available")
            #: exactly what was registered with NIXL (the pool's regions, nothing else): (base, nbytes, type)
            self.registered: list[tuple[int, int, str]] = [(r.base, r.nbytes, r.mem_type) for r in regions]
            by_type: dict[str, list[tuple[int, int, int, str]]] = {}
            for r in regions:
                by_type.setdefault(r.mem_type, []).append((r.base, r.nbytes, r.device_id, ""))
            for mem_type, descs in by_type.items():
                self._regs.append(self._agent.register_memory(descs, mem_type))
            self.metadata: bytes = self._agent.get_agent_metadata()
        except BaseException:
            self.close()
            raise
        log.info("NIXL agent %s registered %d region(s), %d bytes", name, len(regions),
                 sum(r.nbytes for r in regions))

    def start_progress(self) -> None:
        """Start the thread that drives the agent (see the module docstring)."""
        if self._thread is None and not self._closed:
            self._thread = threading.Thread(target=self._progress, name=f"{self.name}-progress", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Make progress now and poll at the busy pace (a lease just opened); cheap, any thread."""
        self._wake.set()

    def _progress(self) -> None:
        last_error = 0.0
        while not self._stop.is_set():
            self._wake.clear()  # before progressing: a wake from here on makes the next wait return at once
            try:
                self._agent.get_new_notifs()  # drives the UCX worker; sources expect no notifications
            except Exception as e:
                now = time.monotonic()
                if now - last_error > 10:
                    log.warning("NIXL agent %s: progress failed: %s", self.name, e)
                    last_error = now
            self._wake.wait(self._busy_interval if self._busy() else self._idle_interval)

    def close(self) -> None:
        """Stop progress, deregister the pool, drop the agent; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5)
            self._thread = None
        agent, self._agent = self._agent, None
        if agent is None:
            return
        for reg in self._regs:
            try:
                agent.deregister_memory(reg)
            except Exception as e:
                log.warning("NIXL agent %s: deregistering memory failed: %s", self.name, e)
        self._regs.clear()
        del agent  # the last reference: the C++ agent is destroyed here, not at interpreter exit
        log.info("NIXL agent %s closed", self.name)
