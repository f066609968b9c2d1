"""The transfer adapter contract: how one target rank READs extents out of a source rank's memory.

A target rank owns one :class:`TransferAdapter` (chosen by name through the
adapter registry, kind ``"transfer"``: ``nixl`` moves bytes between processes,
``memcpy`` copies within one process for tests). Exactly one thread uses it —
the rank's transfer worker — so implementations need no locking.

Life of an adapter::

    t = load_adapter("transfer", "nixl")(f"remote-g2-target-{worker}-tp{rank}")
    t.register_local([MemoryRegion(base, nbytes)])      # the rank's destination pool, once
    t.add_peer(agent_name, agent_metadata)               # once per source agent (again after its epoch changed)
    h = t.start_read(agent_name, local, remote, nbytes, not_after=deadline)  # one per (request, source rank)
    while (s := t.poll(h)) == "pending": ...             # never blocks
    t.release(h)                                         # after done or error; aborts one still running
    t.close()

Extents are three equally long ``uint64`` arrays (local address, remote
address, length), already coalesced by the planner; an adapter issues them as
one transfer. ``poll`` answers ``"pending"``, ``"done"`` (every byte landed)
or ``"error"`` (nothing about the destination bytes is promised). An
adapter may also offer ``failure(handle) -> str``: why a READ ended in
``"error"``, in the backend's words; a failed load's message carries it
(optional, so wrappers and test adapters need not have it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, Protocol, runtime_checkable

import numpy as np

from .memory.secondary_pool import MemoryRegion

__all__ = ["TransferAdapter", "TransferState", "TransferHandle"]

TransferState = Literal["pending", "done", "error"]


class TransferHandle(Protocol):
    """Opaque per-transfer token of an adapter."""


@runtime_checkable
class TransferAdapter(Protocol):
    """Moves bytes from a peer's registered memory into this rank's registered memory."""

    name: str

    def register_local(self, regions: Sequence[MemoryRegion]) -> None:
        """Register the destination memory (once, before any read)."""
        ...

    def add_peer(self, agent_name: str, metadata: bytes) -> None:
        """Load a source agent's metadata; replaces an earlier load of the same name."""
        ...

    def has_peer(self, agent_name: str) -> bool:
        ...

    def remove_peer(self, agent_name: str) -> None:
        """Forget a source agent (it restarted or went away); unknown names are ignored."""
        ...

    def start_read(self, agent_name: str, local_addr: np.ndarray, remote_addr: np.ndarray,
                   nbytes: np.ndarray, *, not_after: float | None = None) -> TransferHandle:
        """Start one READ of every extent; raises :class:`~remote_g2.errors.TransferError` if it cannot start.

        ``not_after`` is a ``time.monotonic()`` instant: an adapter checks it as
        the last thing before bytes start to move, and raises instead of
        starting later than that (the caller may have given the destination up).
        """
        ...

    def poll(self, handle: TransferHandle) -> TransferState:
        """The transfer's state, without blocking."""
        ...

    def release(self, handle: TransferHandle) -> None:
        """Free the handle; a transfer still running is aborted first. Idempotent."""
        ...

    def close(self) -> None:
        """Release everything, in an order the backend survives; idempotent."""
        ...
