"""First-fit ranges of one byte region: the allocator behind source staging and target bounce regions.

:class:`FirstFit` hands out aligned ``(offset, size)`` ranges of a region of
``nbytes`` and takes them back, merging free neighbours. It does no
locking and knows no owners: the staging arena (``source/staging.py``)
calls it under its lock and ties ranges to leases; a target rank's bounce
region (``target/bounce.py``) is used by that rank's one worker thread.
"""

from __future__ import annotations

import bisect

__all__ = ["FirstFit"]


class FirstFit:
    """Aligned first-fit ranges of ``[0, nbytes)``; ``nbytes`` is rounded down to the alignment."""

    def __init__(self, nbytes: int, align: int) -> None:
        if align < 1 or nbytes < align:
            raise ValueError(f"a region of {nbytes} B cannot hold one {align}-byte aligned range")
        self.align = align
        self.nbytes = nbytes - nbytes % align
        self._free: list[tuple[int, int]] = [(0, self.nbytes)]  # (offset, length), sorted, never adjacent
        self.in_use = 0

    def size_of(self, nbytes: int) -> int:
        """The bytes a range asked for ``nbytes`` occupies (rounded up to the alignment)."""
        if nbytes <= 0:
            raise ValueError(f"ranges are at least 1 byte, asked {nbytes}")
        return -(-nbytes // self.align) * self.align

    def take(self, nbytes: int) -> tuple[int, int] | None:
        """The lowest free range that holds ``nbytes``, as ``(offset, size)``; None: no room."""
        size = self.size_of(nbytes)
        for i, (off, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (off + size, length - size)
                self.in_use += size
                return off, size
        return None

    def free(self, offset: int, size: int) -> None:
        """Give back a range :meth:`take` returned, merged with its free neighbours."""
        off, end = offset, offset + size
        i = bisect.bisect_left(self._free, (off, 0))
        if i < len(self._free) and self._free[i][0] == end:  # the next free range starts where this one ends
            end += self._free[i][1]
            del self._free[i]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == off:  # the previous one ends where it starts
            off = self._free[i - 1][0]
            del self._free[i - 1]
            i -= 1
        self._free.insert(i, (off, end - off))
        self.in_use -= size
