"""The ``nixl`` transfer adapter: READs from a source agent's memory with a real NIXL agent (UCX backend).

The agent runs without NIXL's listen thread (agent metadata travels in the
RPCs and is loaded with :meth:`NixlTransfer.add_peer`) and without its
progress thread (with no delay configured it spins a core). Progress is
driven by :meth:`NixlTransfer.poll` instead, so a caller must keep polling
an open transfer until it is no longer ``"pending"``.

On one host (UCX ``cma``) NIXL copies DRAM inside the post, so
:meth:`~NixlTransfer.start_read` returns after the bytes landed (how long, by
descriptor count: docs/benchmarks.md, "descriptor cost") and the first poll
says ``"done"``;
across hosts (RDMA, or UCX over TCP) the post returns at once and polling
does the waiting. Over TCP, UCX emulates READ in software: each READ also
needs the source's progress (source/rank_agent.py).

A READ that ends in error keeps the backend's own words
(:meth:`NixlTransfer.failure`): NIXL reports a status (``NIXL_ERR_BACKEND``,
...), while UCX's reason ("connection refused", a dial that reached this
very host) goes to stderr at ``UCX_LOG_LEVEL=error`` or above, which the
message points to.

Remote extents are DRAM on device 0 (the source pools are host memory);
local extents take the memory type and device of the registered regions.
One thread uses an instance (see :mod:`remote_g2.transfer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from remote_g2.errors import TransferError

from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.transfer import TransferState
from remote_g2.ucx_modules import keep_one_verbs_stack

__all__ = ["NixlTransfer", "Prepared"]

log = logging.getLogger("remote_g2.adapters.nixl")

_PROGRESS_INTERVAL_S = 0.001
_UCX_HINT = (" (UCX logs its reason to this process's stderr at UCX_LOG_LEVEL=error or above; across hosts "
             "see docs/operations.md, 'Across hosts')")


class _Read:
    """One READ: the NIXL handle (``None`` once released), its peer, descriptor count and last known state."""

    __slots__ = ("xfer", "peer", "count", "state", "error")

    def __init__(self, xfer: Any, peer: str, count: int, state: TransferState = "pending") -> None:
        self.xfer, self.peer, self.count, self.state = xfer, peer, count, state
        self.error = ""  # the backend's words when state became "error"

    def __repr__(self) -> str:
        return f"<NIXL READ from {self.peer}: {self.count} descriptor(s), {self.state}>"


class Prepared:
    """A descriptor list NIXL prepared once (:meth:`NixlTransfer.prepare`): READs pick its entries by index."""

    __slots__ = ("dlist", "peer", "count")

    def __init__(self, dlist: Any, peer: str | None, count: int) -> None:
        self.dlist, self.peer, self.count = dlist, peer, count

    def __repr__(self) -> str:
        return f"<NIXL prepared list of {self.count} extent(s), {self.peer or 'local'}>"


class NixlTransfer:
    """:class:`~remote_g2.transfer.TransferAdapter` over one NIXL agent called ``agent_name``."""

    def __init__(self, agent_name: str) -> None:
        try:
            from nixl._api import nixl_agent, nixl_agent_config
        except ImportError as e:
            raise TransferError(f"NIXL is not importable ({e}); the nixl transfer adapter needs it") from e
        self.name = agent_name
        self._regs: list[Any] = []
        self._local_kind: tuple[str, int] | None = None  # (mem_type, device_id) of every local region
        self._peers: set[str] = set()
        self._live: set[_Read] = set()  # started, not yet released
        self._prepared: set[Prepared] = set()  # not yet released
        self._last_progress = 0.0
        keep_one_verbs_stack()  # (before UCX loads its modules: see remote_g2.ucx_modules)
        self._agent: Any = nixl_agent(agent_name, nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        if "UCX" not in self._agent.backends:
            self.close()
            raise TransferError(f"NIXL agent {agent_name}: the UCX backend is not available")

    @property
    def metadata(self) -> bytes:
        """This agent's own metadata (what a peer would load to reach us)."""
        return self._live_agent().get_agent_metadata()

    def register_local(self, regions: Sequence[MemoryRegion]) -> None:
        """Register each region; all of them must share one memory type and device (one READ uses one)."""
        agent = self._live_agent()
        for r in regions:
            kind = (r.mem_type, r.device_id)
            if self._local_kind not in (None, kind):
                raise TransferError(f"NIXL agent {self.name}: local regions mix {self._local_kind} and {kind}")
            try:
                self._regs.append(agent.register_memory([(r.base, r.nbytes, r.device_id, "")], r.mem_type))
            except Exception as e:
                raise TransferError(f"NIXL agent {self.name}: cannot register {r}: {e}") from e
            self._local_kind = kind

    def add_peer(self, agent_name: str, metadata: bytes) -> None:
        """Load ``metadata``, dropping an earlier load (and aborting its reads) first; it must name ``agent_name``."""
        agent = self._live_agent()
        self.remove_peer(agent_name)  # a restarted source has new metadata under the same name
        try:
            loaded = agent.add_remote_agent(metadata)
        except Exception as e:
            # UCX connects to the peer here: an unreachable or self-dialled address fails now.
            raise TransferError(f"cannot load the metadata of NIXL agent {agent_name!r}: {e}{_UCX_HINT}") from e
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != agent_name:
            if loaded not in self._peers:  # never unload a peer that was loaded under its own name
                self._forget(loaded)
            raise TransferError(f"metadata given for NIXL agent {agent_name!r} belongs to {loaded!r}")
        self._peers.add(agent_name)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def remove_peer(self, agent_name: str) -> None:
        """Forget a peer; reads still open to it are aborted first (they poll ``"error"``)."""
        if agent_name not in self._peers:
            return
        for read in [r for r in self._live if r.peer == agent_name]:
            self.release(read)  # a handle must not outlive the remote metadata it points into
        for prepared in [p for p in self._prepared if p.peer == agent_name]:
            self.unprepare(prepared)
        self._peers.discard(agent_name)
        self._forget(agent_name)

    def start_read(self, agent_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
                   nbytes: np.ndarray, *, not_after: float | None = None) -> _Read:
        """Post one READ of every extent; :class:`TransferError` if the peer is unknown, NIXL refuses it, or
        ``not_after`` (monotonic) passed before the post."""
        agent = self._live_agent()
        if agent_name not in self._peers:
            raise TransferError(f"no metadata loaded for agent {agent_name!r}")
        n = len(nbytes)
        if not len(local_addr) == len(remote_addr) == n:
            raise TransferError(f"READ from {agent_name}: extent arrays differ in length "
                                f"({len(local_addr)}, {len(remote_addr)}, {n})")
        if n == 0:
            return _Read(None, agent_name, 0, "done")
        mem_type, dev = self._local_kind or ("DRAM", 0)
        local = np.empty((n, 3), dtype=np.uint64)
        local[:, 0], local[:, 1], local[:, 2] = local_addr, nbytes, dev
        remote = local.copy()
        remote[:, 0], remote[:, 2] = remote_addr, 0
        what = f"READ of {n} descriptor(s) from NIXL agent {agent_name}"
        try:
            xfer = agent.initialize_xfer("READ", agent.get_xfer_descs(local, mem_type),
                                         agent.get_xfer_descs(remote, "DRAM"), agent_name, b"")
        except Exception as e:
            raise TransferError(f"{what} could not be prepared: {e}") from e
        return self._post(_Read(xfer, agent_name, n), what, not_after)

    def _post(self, read: _Read, what: str, not_after: float | None) -> _Read:
        """Start a READ whose request is made (released here if it cannot start)."""
        self._live.add(read)
        if not_after is not None and time.monotonic() > not_after:
            # Checked after the (possibly slow) preparation, right before bytes start to move: the
            # caller may already have given these destination blocks up.
            self.release(read)
            raise TransferError(f"{what} not posted: its deadline passed "
                                f"{(time.monotonic() - not_after) * 1e3:.1f} ms ago")
        try:
            state, why = self._live_agent().transfer(read.xfer), "NIXL answered ERR"
        except Exception as e:
            state, why = "ERR", str(e)
        if state == "ERR":
            self.release(read)
            raise TransferError(f"{what} could not start: {why}")
        if state == "DONE":
            read.state = "done"
        return read

    def prepare(self, agent_name: str | None, addr: np.ndarray, nbytes: np.ndarray) -> Prepared:
        """Prepare extents once, for :meth:`start_read_prepared`: a peer's (``agent_name``) or this agent's own
        (None). A READ then skips building descriptor lists and a request from scratch, which is most of a
        small READ's cost, and most of all on a core that was idle (docs/benchmarks.md, "remote-g2 as a vLLM
        tier"). :class:`TransferError` if the peer is unknown or NIXL refuses the extents."""
        agent = self._live_agent()
        if agent_name is not None and agent_name not in self._peers:
            raise TransferError(f"no metadata loaded for agent {agent_name!r}")
        n = len(nbytes)
        mem_type, dev = (self._local_kind or ("DRAM", 0)) if agent_name is None else ("DRAM", 0)
        descs = np.empty((n, 3), dtype=np.uint64)
        descs[:, 0], descs[:, 1], descs[:, 2] = addr, nbytes, dev
        try:
            dlist = agent.prep_xfer_dlist(agent_name or "NIXL_INIT_AGENT", descs, mem_type)
        except Exception as e:
            raise TransferError(f"NIXL agent {self.name}: cannot prepare {n} extent(s) of "
                                f"{agent_name or 'its own memory'}: {e}") from e
        prepared = Prepared(dlist, agent_name, n)
        self._prepared.add(prepared)
        return prepared

    def unprepare(self, prepared: Prepared) -> None:
        """Release a prepared list (idempotent)."""
        if prepared not in self._prepared:
            return
        self._prepared.discard(prepared)
        try:
            self._live_agent().release_dlist_handle(prepared.dlist)
        except Exception as e:
            log.warning("NIXL agent %s: releasing %r failed: %s", self.name, prepared, e)

    def start_read_prepared(self, local: Prepared, local_idx: np.ndarray, remote: Prepared, remote_idx: np.ndarray,
                            *, not_after: float | None = None) -> _Read:
        """Post one READ of ``remote``'s extents ``remote_idx`` into ``local``'s ``local_idx`` (pairwise); as
        :meth:`start_read` otherwise."""
        agent = self._live_agent()
        peer = remote.peer
        if peer is None or local.peer is not None or peer not in self._peers or \
                local not in self._prepared or remote not in self._prepared:
            raise TransferError(f"READ from {peer}: not a live pair of prepared lists ({local!r}, {remote!r})")
        n = len(remote_idx)
        if len(local_idx) != n:
            raise TransferError(f"READ from {peer}: index arrays differ in length ({len(local_idx)}, {n})")
        if n == 0:
            return _Read(None, peer, 0, "done")
        what = f"READ of {n} prepared extent(s) from NIXL agent {peer}"
        try:
            xfer = agent.make_prepped_xfer("READ", local.dlist, np.asarray(local_idx, np.int32), remote.dlist,
                                           np.asarray(remote_idx, np.int32))
        except Exception as e:
            raise TransferError(f"{what} could not be prepared: {e}") from e
        return self._post(_Read(xfer, peer, n), what, not_after)

    def poll(self, handle: _Read) -> TransferState:
        """``"pending"``, ``"done"`` or ``"error"``; drives NIXL's progress (at most every ~1 ms), never blocks."""
        if handle.state != "pending" or handle.xfer is None:
            return handle.state
        agent = self._live_agent()
        now = time.monotonic()
        if now - self._last_progress >= _PROGRESS_INTERVAL_S:
            self._last_progress = now
            try:
                agent.get_new_notifs()  # progresses the UCX worker; no notifications are expected
            except Exception as e:
                log.warning("NIXL agent %s: progress failed: %s", self.name, e)
        try:
            state = agent.check_xfer_state(handle.xfer)
        except Exception as e:  # NIXL's bindings raise the failed status (e.g. nixlBackendError: NIXL_ERR_BACKEND)
            handle.error = f"{type(e).__name__}: {e}"
            state = "ERR"
        if state == "DONE":
            handle.state = "done"
        elif state == "ERR":
            handle.state = "error"
            handle.error = handle.error or "NIXL reported the transfer's state as ERR"
        return handle.state

    def failure(self, handle: _Read) -> str:
        """Why ``handle`` ended in ``"error"``, in the backend's words, with where UCX's own reason goes."""
        if handle.state != "error":
            return ""
        why = handle.error or "aborted before it finished"
        return f"NIXL READ from {handle.peer} failed: {why}{_UCX_HINT}"

    def release(self, handle: _Read) -> None:
        """Free the NIXL handle (aborting a running READ, which then counts as ``"error"``); idempotent."""
        xfer, handle.xfer = handle.xfer, None
        if xfer is None:
            return
        self._live.discard(handle)
        if handle.state == "pending":
            handle.state = "error"
        try:
            self._agent.release_xfer_handle(xfer)
        except Exception as e:
            # NIXL keeps a handle it could not abort and retries when the agent is destroyed.
            log.warning("NIXL agent %s: releasing %r failed: %s", self.name, handle, e)

    def close(self) -> None:
        """Release open reads, deregister memory, forget peers, drop the agent — the order NIXL survives."""
        if self._agent is None:
            return
        for read in list(self._live):
            self.release(read)
        for prepared in list(self._prepared):
            self.unprepare(prepared)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                log.warning("NIXL agent %s: deregistering memory failed: %s", self.name, e)
        self._regs = []
        for peer in list(self._peers):
            self._forget(peer)
        self._peers = set()
        agent, self._agent = self._agent, None
        del agent  # the last reference: the C++ agent dies now, not during interpreter exit

    def _forget(self, agent_name: str) -> None:
        try:
            self._agent.remove_remote_agent(agent_name)
        except Exception as e:
            log.warning("NIXL agent %s: removing peer %s failed: %s", self.name, agent_name, e)

    def _live_agent(self) -> Any:
        if self._agent is None:
            raise TransferError(f"NIXL transfer adapter {self.name} is closed")
        return self._agent
