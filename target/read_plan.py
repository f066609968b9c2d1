"""What one target rank reads for one load: a :class:`ReadPlan` of per-source-rank extents.

Built by :mod:`.tp_mapping` (:func:`~.tp_mapping.plan_reads`, :class:`~.tp_mapping.ReadPlanner`)
and executed by the rank's transfer adapter, one READ per (request, source
rank). Addresses and lengths are held as read-only numpy arrays, ready as the
``(address, length, device)`` descriptor lists NIXL takes.
"""

from __future__ import annotations

from dataclasses import dataclass
import numpy as np

from remote_g2.tp.head_slices import PlanMode

__all__ = ["PlanMode", "ReadExtent", "SourceReads", "ReadPlan", "frozen"]


@dataclass(frozen=True, slots=True)
class ReadExtent:
    """One contiguous READ: ``nbytes`` from ``remote_addr`` on ``source_rank`` to ``local_addr``."""

    source_rank: int
    remote_addr: int
    local_addr: int
    nbytes: int


def frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


@dataclass(frozen=True, eq=False)
class SourceReads:
    """Every extent one target rank reads from one source rank: one READ per request.

    The three arrays are ``uint64``, read-only, equally long, sorted by
    ``remote_addr``; row ``i`` is one descriptor.

    A part its source rank stages while it is read (``ready_addr`` non-zero;
    ``remote_addr`` then lies in the rank's staging region) has ``need``:
    row ``i`` may be read once the u64 counter at ``ready_addr`` reaches
    ``need[i]`` (non-decreasing; ``source/gather.py`` advances the counter).
    """

    source_rank: int
    agent_name: str
    remote_addr: np.ndarray
    local_addr: np.ndarray
    nbytes: np.ndarray
    ready_addr: int = 0
    need: np.ndarray | None = None

    @property
    def num_descriptors(self) -> int:
        return int(self.nbytes.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum(dtype=np.uint64))

    def remote_descs(self, dev_id: int = 0) -> np.ndarray:
        """An ``(N, 3)`` ``uint64`` array of ``(address, nbytes, dev_id)``: NIXL's descriptor-list form."""
        return _descs(self.remote_addr, self.nbytes, dev_id)

    def local_descs(self, dev_id: int = 0) -> np.ndarray:
        """The local side of :meth:`remote_descs`, row for row."""
        return _descs(self.local_addr, self.nbytes, dev_id)

    def extents(self) -> list[ReadExtent]:
        """The descriptors as objects (for tests and logs; the arrays are the fast path)."""
        r = self.source_rank
        return [ReadExtent(r, a, b, n) for a, b, n in
                zip(self.remote_addr.tolist(), self.local_addr.tolist(), self.nbytes.tolist())]


def _descs(addr: np.ndarray, nbytes: np.ndarray, dev_id: int) -> np.ndarray:
    out = np.empty((addr.shape[0], 3), dtype=np.uint64)
    out[:, 0] = addr
    out[:, 1] = nbytes
    out[:, 2] = dev_id
    return out


@dataclass(frozen=True, eq=False)
class ReadPlan:
    """What one target rank reads for one request, grouped by source rank.

    ``reads`` holds one :class:`SourceReads` per source rank this target rank
    reads from (ascending rank), none when there is nothing to read.
    """

    target_rank: int
    mode: PlanMode
    num_blocks: int
    reads: tuple[SourceReads, ...]

    @property
    def source_ranks(self) -> tuple[int, ...]:
        return tuple(r.source_rank for r in self.reads)

    @property
    def num_descriptors(self) -> int:
        return sum(r.num_descriptors for r in self.reads)

    @property
    def total_bytes(self) -> int:
        return sum(r.total_bytes for r in self.reads)

    def for_source(self, source_rank: int) -> SourceReads | None:
        """The reads from ``source_rank``, or None when this target rank reads nothing there."""
        for r in self.reads:
            if r.source_rank == source_rank:
                return r
        return None

    def extents(self) -> list[ReadExtent]:
        """Every descriptor as an object, grouped by source rank."""
        return [e for r in self.reads for e in r.extents()]
