"""A source rank's staging region: registered memory a gather packs a lease's pieces into, freed with the lease.

One region per rank, allocated and registered with the rank's NIXL agent at
start-up (its address travels in :class:`~remote_g2.protocol.messages.RankInfo`), so
a reader READs a staged run like any pool block. :class:`StagingArena`
hands out byte ranges of it to leases:

* :meth:`StagingArena.take` — first fit, 4 KiB aligned; None when the
  region has no room (the budget: the caller reads in place instead);
* :meth:`StagingArena.filled` — the gather that took a range finished
  writing it; False when the lease ended meanwhile (the range is free again
  and must not be handed to a reader);
* :meth:`StagingArena.release` — the lease ended (release, expiry, trim to
  nothing, shutdown): every range it holds is free again — except one a
  gather is still writing, which is freed when that gather says
  :meth:`filled`. So no range is ever written by two gathers at once, and
  none outlives its lease.

A range is the lease's for exactly as long as its pins: a reader that READs
after its lease ended may read another lease's bytes, which is why a load's
outcome waits for its release's answer (docs/target.md). Thread-safe.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from remote_g2.memory.first_fit import FirstFit
from remote_g2.memory.host_memory import huge_page_buffer

__all__ = ["StagingArena", "ALIGN"]

ALIGN = 4096  # every range starts on a page: a READ of it never shares a page with another lease's range


@dataclass(slots=True)
class _Range:
    offset: int
    nbytes: int
    busy: bool = True     # a gather is writing it
    doomed: bool = False  # its lease ended while it was busy: free it once the gather is done
    #: set to 1 when ``doomed``: the writer reads it without the GIL between chunks (``pack_chunks``)
    stop: np.ndarray = field(default_factory=lambda: np.zeros(1, dtype=np.uint64))


class StagingArena:
    """Ranges of one ``nbytes`` region, owned by lease ids (see the module docstring)."""

    def __init__(self, nbytes: int, *, on_change: Callable[[int], None] | None = None) -> None:
        if nbytes < ALIGN:
            raise ValueError(f"a staging region needs at least {ALIGN} bytes, got {nbytes}")
        self._ranges = FirstFit(nbytes, ALIGN)
        nbytes = self._ranges.nbytes
        self.buffer: np.ndarray = huge_page_buffer(nbytes)
        self.buffer.fill(0)  # touch every page now: a gather must not pay the first-touch faults
        self.base = int(self.buffer.ctypes.data)
        self._words = self.buffer.view(np.uint64)  # the staged-blocks counters (source/gather.py)
        self.nbytes = nbytes
        self._leases: dict[int, list[_Range]] = {}
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def in_use(self) -> int:
        """Bytes held by leases (busy ones included)."""
        return self._ranges.in_use

    def held_by(self, lease_id: int) -> int:
        """Bytes ``lease_id`` holds (0: none)."""
        with self._lock:
            return sum(r.nbytes for r in self._leases.get(lease_id, ()))

    def take(self, lease_id: int, nbytes: int) -> int | None:
        """A range of at least ``nbytes`` for ``lease_id``, as an address, marked busy; None: no room."""
        size = self._ranges.size_of(nbytes)
        with self._lock:
            got = self._ranges.take(size)
            if got is None:
                return None
            off = got[0]
            self._leases.setdefault(lease_id, []).append(_Range(off, size))
            in_use = self._ranges.in_use
        self._changed(in_use)
        return self.base + off

    def filled(self, lease_id: int, addr: int) -> bool:
        """The gather into ``addr`` is done; False (and the range freed) when its lease ended meanwhile."""
        offset = addr - self.base
        with self._lock:
            ranges = self._leases.get(lease_id, [])
            r = next((r for r in ranges if r.offset == offset), None)
            if r is None:
                raise ValueError(f"staging range at {addr:#x} is not lease {lease_id}'s")
            r.busy = False
            if not r.doomed:
                return True
            ranges.remove(r)
            if not ranges:
                del self._leases[lease_id]
            in_use = self._free_range(r)
        self._changed(in_use)
        return False

    def stop_word(self, lease_id: int, addr: int) -> int:
        """The address of the busy range's stop word: non-zero once its lease ended (the writer should stop)."""
        offset = addr - self.base
        with self._lock:
            r = next((r for r in self._leases.get(lease_id, ()) if r.offset == offset), None)
            if r is None:
                raise ValueError(f"staging range at {addr:#x} is not lease {lease_id}'s")
            return int(r.stop.ctypes.data)

    def ended(self, lease_id: int, addr: int) -> bool:
        """Whether the lease that took the busy range at ``addr`` ended meanwhile (its gather should stop)."""
        offset = addr - self.base
        with self._lock:
            r = next((r for r in self._leases.get(lease_id, ()) if r.offset == offset), None)
            return r is None or r.doomed

    def store_word(self, addr: int, value: int) -> None:
        """Store ``value`` as the u64 at ``addr`` (8-byte aligned, inside a range the caller holds)."""
        offset = addr - self.base
        if offset % 8 or not 0 <= offset < self.nbytes:
            raise ValueError(f"{addr:#x} is not an aligned word of the staging region")
        self._words[offset // 8] = value

    def release(self, lease_id: int) -> int:
        """Free every range of ``lease_id`` (a busy one once its gather is done); bytes freed now."""
        with self._lock:
            ranges = self._leases.get(lease_id)
            if not ranges:
                return 0
            freed = 0
            for r in list(ranges):
                if r.busy:
                    r.doomed = True
                    r.stop[0] = 1
                    continue
                ranges.remove(r)
                freed += r.nbytes
                in_use = self._free_range(r)
            if not ranges:
                del self._leases[lease_id]
            if not freed:
                return 0
        self._changed(in_use)
        return freed

    def _free_range(self, r: _Range) -> int:
        """Give ``r`` back (lock held); bytes in use after."""
        self._ranges.free(r.offset, r.nbytes)
        return self._ranges.in_use

    def _changed(self, in_use: int) -> None:
        if self._on_change is not None:
            self._on_change(in_use)
