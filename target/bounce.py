"""A target rank's bounce region: a READ of many small scattered pieces lands in one run, then is scattered here.

Where a rank's destination pieces are small and scattered but the source's
are adjacent — a part its source rank staged (``source/gather.py``) read
into another TP size's head slices (TP 2 → 1 with a head per source rank),
or a source block read into a target block slab by slab — each piece is a
descriptor of its own, and below some size a descriptor costs more than
copying its bytes twice. Then the rank READs those rows into a range of its
bounce region instead (adjacent on both sides, they coalesce: one
descriptor per staged chunk, or per source block) and, once that READ is
done, copies every piece to its destination itself
(:func:`~remote_g2.memory.extent_copy.copy_extents`, the GIL released).

The rule (:func:`bounce_plan`), per :class:`~.read_plan.SourceReads` of a
load: at least ``BOUNCE_MIN_DESCRIPTORS`` descriptors, of at most
``BOUNCE_MAX_PIECE`` bytes on average, and bouncing at least halves them.
Measured: one READ into a bounce buffer plus the local scatter against a
READ straight into the scattered destination
(``bench/diagnostics/bench_descriptor_cost.py``, docs/benchmarks.md): the
bounce wins at 4 KiB pieces and loses from 8 KiB up. A load that does
not fit in the region's free room reads in place (never a failure).

Ranges are first fit, 4 KiB aligned, owned by one load: a load that
succeeded gives its ranges back when it is reported; a failed load's
ranges sit out ``BOUNCE_QUARANTINE_S`` first — a READ aborted at its
deadline may still land in them. The region is registered with the rank's
transfer adapter beside its pool; one thread (the rank's worker) uses it.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from remote_g2.memory.extent_copy import copy_extents
from remote_g2.memory.first_fit import FirstFit
from remote_g2.memory.host_memory import huge_page_buffer
from remote_g2.memory.secondary_pool import MemoryRegion

from .read_plan import SourceReads, frozen

__all__ = ["BounceRegion", "Bounce", "bounce_plan", "BOUNCE_MAX_PIECE", "BOUNCE_MIN_DESCRIPTORS",
           "BOUNCE_QUARANTINE_S"]

BOUNCE_MAX_PIECE = 4096       # mean destination piece (bytes) at or below which bouncing pays (measured)
BOUNCE_MIN_DESCRIPTORS = 16   # fewer descriptors than this cost too little to save
BOUNCE_QUARANTINE_S = 30.0
_ALIGN = 4096


@dataclass(frozen=True, eq=False)
class Bounce:
    """One :class:`SourceReads` redirected into a bounce range, and how to scatter it.

    ``reads`` is what the rank READs: the source rows, coalesced, into the
    range (for a staged part with the same ``ready_addr`` and a ``need`` per
    row, so it is read chunk by chunk as before). ``ends[i]`` is one past
    the last original row that read row ``i`` carries; ``local``,
    ``bounced`` and ``nbytes`` are the original rows' destinations, bounce
    addresses and lengths.
    """

    reads: SourceReads
    ends: np.ndarray
    local: np.ndarray
    bounced: np.ndarray
    nbytes: np.ndarray
    offset: int
    size: int

    def scatter(self, lo: int, hi: int) -> int:
        """Copy the pieces read rows ``[lo, hi)`` carry to their destinations; the bytes copied."""
        a = 0 if lo == 0 else int(self.ends[lo - 1])
        b = int(self.ends[hi - 1])
        return copy_extents(self.local[a:b], self.bounced[a:b], self.nbytes[a:b])


def bounce_plan(reads: SourceReads, base: int) -> tuple[SourceReads, np.ndarray, np.ndarray] | None:
    """``reads`` redirected to land back to back from address ``base``: (the coalesced reads, ``ends``, each
    original row's bounce address); None when the rule says read in place (see the module docstring)."""
    n = reads.num_descriptors
    if n < BOUNCE_MIN_DESCRIPTORS or reads.total_bytes > n * BOUNCE_MAX_PIECE:
        return None
    u = np.uint64
    remote, nbytes = reads.remote_addr, reads.nbytes
    joins = remote[:-1] + nbytes[:-1] == remote[1:]  # bounce rows are adjacent by construction
    if reads.need is not None:
        joins &= reads.need[:-1] == reads.need[1:]  # one READ per staged chunk: a chunk may be ready first
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    if 2 * starts.shape[0] > n:
        return None
    offsets = np.empty(n, dtype=u)
    offsets[0] = 0
    np.cumsum(nbytes[:-1], out=offsets[1:])
    bounced = u(base) + offsets
    ends = np.append(starts[1:], n).astype(np.int64)
    need = None if reads.need is None else frozen(reads.need[starts])
    out = SourceReads(reads.source_rank, reads.agent_name, frozen(remote[starts]), frozen(bounced[starts]),
                      frozen(np.add.reduceat(nbytes, starts)), reads.ready_addr, need)
    return out, ends, bounced


class BounceRegion:
    """This rank's bounce region (see the module docstring): ranges of it per load, the rule applied."""

    def __init__(self, nbytes: int) -> None:
        self._ranges = FirstFit(nbytes, _ALIGN)
        self.buffer: np.ndarray = huge_page_buffer(self._ranges.nbytes)
        self.buffer.fill(0)  # touch every page now: a load must not pay the first-touch faults
        self.base = int(self.buffer.ctypes.data)
        self.nbytes = self._ranges.nbytes
        self._quarantined: deque[tuple[float, int, int]] = deque()

    @property
    def region(self) -> MemoryRegion:
        return MemoryRegion(self.base, self.nbytes)

    @property
    def in_use(self) -> int:
        """Bytes held by loads in flight and by failed loads' quarantined ranges."""
        return self._ranges.in_use

    def land(self, reads: SourceReads) -> Bounce | None:
        """``reads`` redirected into a fresh range when the rule says so and there is room; None: read in place."""
        now = time.monotonic()
        while self._quarantined and self._quarantined[0][0] <= now:
            _, offset, size = self._quarantined.popleft()
            self._ranges.free(offset, size)
        total = reads.total_bytes
        if total == 0 or total > self._ranges.nbytes:
            return None
        planned = bounce_plan(reads, 0)  # the rule first: most reads never take a range
        if planned is None:
            return None
        got = self._ranges.take(total)
        if got is None:
            return None
        offset, size = got
        shift = np.uint64(self.base + offset)
        out, ends, bounced = planned
        moved = SourceReads(out.source_rank, out.agent_name, out.remote_addr, frozen(out.local_addr + shift),
                            out.nbytes, out.ready_addr, out.need)
        return Bounce(moved, ends, reads.local_addr, frozen(bounced + shift), reads.nbytes, offset, size)

    def give_back(self, bounce: Bounce, *, failed: bool) -> None:
        """The load ended: its range is free now, or after ``BOUNCE_QUARANTINE_S`` when it failed."""
        if failed:
            self._quarantined.append((time.monotonic() + BOUNCE_QUARANTINE_S, bounce.offset, bounce.size))
        else:
            self._ranges.free(bounce.offset, bounce.size)
