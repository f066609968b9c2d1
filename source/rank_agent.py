"""This rank's NIXL agent: the pool registered for remote READs, and the progress it needs.

The agent runs without NIXL's listen thread (metadata travels in the RPCs).
Its progress follows :mod:`source.progress_pace`: in ``poll`` mode (the
default, and where NIXL cannot run an event-driven thread) a small thread
of ours calls ``get_new_notifs()`` (which drives the UCX worker) at the
pace's interval for where the open leases' readers are, and at once when
:meth:`wake` says a lease opened, so that a READ posted right after its
resolve never waits out an idle sleep; in ``event`` mode NIXL's own
progress thread, given a finite sleep so that it waits on the UCX worker's
event descriptor instead of spinning a core (NIXL's Python API hard-codes
that sleep to 0, so :func:`_event_driven_agent` sets it on the way to the
bindings).

In poll mode only our thread touches the agent after start-up, and
:meth:`close` stops it before tearing the agent down, so the agent's
thread-unsafe default sync mode is fine; in event mode NIXL's thread only
progresses the (multi-threaded) UCX worker. Teardown order: progress
thread, memory deregistration, agent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.errors import SourceError
from remote_g2.ucx_modules import keep_one_verbs_stack

from .progress_pace import ProgressPace

__all__ = ["RankAgent", "agent_name_for"]

log = logging.getLogger("remote_g2.source.nixl")


def agent_name_for(worker_id: str, rank: int) -> str:
    """``remote-g2-source-{worker_id}-tp{rank}`` (DESIGN.md fixes the form)."""
    return f"remote-g2-source-{worker_id}-tp{rank}"


class RankAgent:
    """Create the agent, register ``regions``; ``start_progress()`` then ``close()``."""

    def __init__(self, name: str, regions: Sequence[MemoryRegion], *, pace: ProgressPace,
                 readers: Callable[[], str] = lambda: "none") -> None:
        if not regions:
            raise SourceError("the pool reports no memory regions to register")
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise SourceError(f"NIXL is not importable ({e}); the source service needs it") from e
        self.name = name
        self._readers = readers
        self.pace = pace  # SourceConfig.progress_pace(): UCX_TLS and the kernel's cma policy read once
        #: the mode in effect: ``event`` (NIXL's thread) or ``poll`` (ours; asked for, or NIXL could not)
        self.progress_mode = "poll"
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._asleep_for = float("inf")  # the interval the progress thread waits out now
        self._thread: threading.Thread | None = None
        self._closed = False
        self._regs: list[Any] = []
        self._agent: Any = None
        keep_one_verbs_stack()  # (before UCX loads its modules: see remote_g2.ucx_modules)
        if self.pace.mode == "event":
            try:
                self._agent = _event_driven_agent(name, self.pace.event_timeout_s)
                self.progress_mode = "event"
            except Exception as e:  # e.g. a UCX built without multi-threading: our polling instead
                log.warning("NIXL agent %s: no event-driven progress (%s); polling instead", name, e)
        if self._agent is None:
            self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
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
        log.info("NIXL agent %s registered %d region(s), %d bytes; progress %s", name, len(regions),
                 sum(r.nbytes for r in regions), self.pace.describe(self.progress_mode))

    def start_progress(self) -> None:
        """Start the thread that drives the agent in poll mode (event mode has NIXL's; see the module docstring)."""
        if self._thread is None and not self._closed and self.progress_mode == "poll":
            self._thread = threading.Thread(target=self._progress, name=f"{self.name}-progress", daemon=True)
            self._thread.start()

    def wake(self) -> None:
        """Poll mode: a lease opened; make progress now if its readers need a faster pace than the one asleep.

        A reader on this host that READs one-sided needs nothing from us once
        wired up, so its leases do not cut a sleep at their own pace short
        (a wake there costs a switch to this thread just as its READ starts).
        """
        if self.pace.poll_interval_s(self._readers()) < self._asleep_for:
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
            self._asleep_for = self.pace.poll_interval_s(self._readers())
            self._wake.wait(self._asleep_for)

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


_BINDINGS_LOCK = threading.Lock()


def _event_driven_agent(name: str, timeout_s: float) -> Any:
    """A NIXL agent whose own progress thread sleeps on the UCX worker's event descriptor.

    NIXL's thread ``poll()``s the worker's event fd for at most its
    ``pthrDelay``; ``nixl_agent`` sets that to 0 (a busy spin) with no way
    to change it, so the config object is given the delay just before it
    reaches the bindings' ``nixlAgent``: the module's ``nixlBind`` is
    swapped, under a lock, for a forwarder for the span of the constructor.
    Raises when this NIXL has no such setting (it would spin) or cannot run
    its thread (UCX without multi-threading).
    """
    import nixl._api as api

    bindings = getattr(api, "nixlBind", None)
    if bindings is None or not hasattr(bindings.nixlAgentConfig(), "pthrDelay"):
        raise SourceError("this NIXL's Python API has no progress-thread delay to set")
    delay_us = max(1000, int(timeout_s * 1e6))  # NIXL rounds up to whole milliseconds

    class _WithDelay:
        def __getattr__(self, attr: str) -> Any:
            return getattr(bindings, attr)

        @staticmethod
        def nixlAgent(agent_name: str, config: Any) -> Any:  # noqa: N802 (the bindings' name)
            config.pthrDelay = delay_us
            return bindings.nixlAgent(agent_name, config)

    with _BINDINGS_LOCK:
        api.nixlBind = _WithDelay()
        try:
            agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=True, enable_listen_thread=False,
                                                               backends=["UCX"]))
        finally:
            api.nixlBind = bindings
    if "UCX" not in agent.backends:
        raise SourceError("the UCX backend did not start with a progress thread")
    return agent
