"""The ``memcpy`` transfer adapter: a source and a target in ONE process, for tests on one box.

A same-process test source publishes its memory under its agent name with
:meth:`MemcpyTransfer.expose` (and withdraws it with :meth:`MemcpyTransfer.unexpose`);
the published table is shared by every instance of the class. A target's
adapter then reads from it like from a NIXL peer: :meth:`~MemcpyTransfer.add_peer`
(the metadata is ignored), :meth:`~MemcpyTransfer.start_read` — which checks
that every extent lies inside memory registered on both sides and copies it
at once with ``ctypes.memmove``, so the handle it returns polls ``"done"``.

    MemcpyTransfer.expose("src-tp0", pool.regions())
    t = MemcpyTransfer("target-tp0"); t.register_local([MemoryRegion(buf_base, buf_len)])
    t.add_peer("src-tp0", b""); h = t.start_read("src-tp0", local, remote, nbytes)
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Sequence
from typing import ClassVar

import numpy as np

from remote_g2.errors import TransferError

from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.transfer import TransferState

__all__ = ["MemcpyTransfer"]


class _Spans:
    """Sorted, non-overlapping [lo, hi) spans, checked vectorised."""

    def __init__(self, regions: Sequence[MemoryRegion]) -> None:
        spans = sorted((r.base, r.base + r.nbytes) for r in regions if r.nbytes > 0)
        for (_, hi), (lo, _) in zip(spans, spans[1:]):
            if lo < hi:
                raise TransferError(f"registered regions overlap at {lo:#x}")
        self.lo = np.array([s[0] for s in spans], dtype=np.uint64)
        self.hi = np.array([s[1] for s in spans], dtype=np.uint64)

    def outside(self, addr: np.ndarray, nbytes: np.ndarray) -> np.ndarray:
        """Indices of the extents not wholly inside one span."""
        i = np.searchsorted(self.lo, addr, side="right").astype(np.int64) - 1
        j = np.maximum(i, 0)
        hi = self.hi[j] if len(self.hi) else np.zeros_like(addr)
        # hi - addr cannot wrap where addr <= hi; elsewhere the first test already fails.
        inside = (i >= 0) & (addr <= hi) & (hi - addr >= nbytes)
        return np.flatnonzero(~inside)


class _Copy:
    __slots__ = ("peer", "count", "released")

    def __init__(self, peer: str, count: int) -> None:
        self.peer, self.count, self.released = peer, count, False


class MemcpyTransfer:
    """:class:`~remote_g2.transfer.TransferAdapter` copying within this process."""

    _exposed: ClassVar[dict[str, _Spans]] = {}
    _exposed_lock: ClassVar[threading.Lock] = threading.Lock()  # sources and targets may run in threads

    @classmethod
    def expose(cls, agent_name: str, regions: Sequence[MemoryRegion]) -> None:
        """Publish ``regions`` as readable memory of agent ``agent_name`` (replacing an earlier call)."""
        spans = _Spans(regions)
        with cls._exposed_lock:
            cls._exposed[agent_name] = spans

    @classmethod
    def unexpose(cls, agent_name: str) -> None:
        """Withdraw ``agent_name``'s memory; later reads from it fail. Unknown names are ignored."""
        with cls._exposed_lock:
            cls._exposed.pop(agent_name, None)

    def __init__(self, agent_name: str) -> None:
        self.name = agent_name
        self._local = _Spans(())
        self._regions: list[MemoryRegion] = []
        self._peers: set[str] = set()
        self._closed = False

    def register_local(self, regions: Sequence[MemoryRegion]) -> None:
        self._check_open()
        self._local = _Spans([*self._regions, *regions])
        self._regions.extend(regions)

    def add_peer(self, agent_name: str, metadata: bytes) -> None:
        """Remember ``agent_name``; ``metadata`` is ignored (memory comes from :meth:`expose`)."""
        self._check_open()
        self._peers.add(agent_name)

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def remove_peer(self, agent_name: str) -> None:
        self._peers.discard(agent_name)

    def start_read(self, agent_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
                   nbytes: np.ndarray, *, not_after: float | None = None) -> _Copy:
        """Copy every extent now; :class:`TransferError` (and nothing written) if any lies outside registered memory."""
        self._check_open()
        if agent_name not in self._peers:
            raise TransferError(f"no metadata loaded for agent {agent_name!r}")
        with self._exposed_lock:
            remote_spans = self._exposed.get(agent_name)
        if remote_spans is None:
            raise TransferError(f"agent {agent_name!r} exposes no memory in this process")
        local, remote, size = (np.asarray(a, dtype=np.uint64).ravel() for a in (local_addr, remote_addr, nbytes))
        if not len(local) == len(remote) == len(size):
            raise TransferError(f"READ from {agent_name}: extent arrays differ in length "
                                f"({len(local)}, {len(remote)}, {len(size)})")
        for side, spans, addr in (("remote", remote_spans, remote), ("local", self._local, local)):
            bad = spans.outside(addr, size)
            if len(bad):
                k = int(bad[0])
                raise TransferError(f"READ of {len(size)} descriptor(s) from {agent_name}: {len(bad)} {side} "
                                    f"extent(s) outside registered memory, first #{k} "
                                    f"({int(addr[k]):#x}, {int(size[k])} bytes)")
        if not_after is not None and time.monotonic() > not_after:
            raise TransferError(f"READ of {len(size)} descriptor(s) from {agent_name} not started: its deadline "
                                f"passed {(time.monotonic() - not_after) * 1e3:.1f} ms ago")
        for dst, src, n in zip(local.tolist(), remote.tolist(), size.tolist()):
            ctypes.memmove(dst, src, n)
        return _Copy(agent_name, len(size))

    def poll(self, handle: _Copy) -> TransferState:
        """Always ``"done"``: :meth:`start_read` copied everything before returning."""
        return "done"

    def release(self, handle: _Copy) -> None:
        handle.released = True

    def close(self) -> None:
        """Forget peers and local memory (what a source exposed stays exposed); idempotent."""
        self._closed = True
        self._peers.clear()
        self._regions.clear()
        self._local = _Spans(())

    def _check_open(self) -> None:
        if self._closed:
            raise TransferError(f"memcpy transfer adapter {self.name} is closed")
