"""Large host buffers backed by transparent huge pages, for memory NIXL reads: G2 pools, staging regions.

Why: on one host NIXL's UCX backend copies with cross-memory attach
(``process_vm_readv``), and over RDMA the NIC translates every page it
touches; either way the cost per 4 KiB page adds up. With the pool in 2 MiB
pages the same 64 MiB fetch runs faster end to end
(``bench/bench_transfer.py --pool-pages huge`` vs ``4k``: the "huge pages"
row of the fetch A/B table in ``docs/benchmarks.md``). NumPy already asks for huge pages for its own large
arrays; torch's CPU allocator does not unless ``THP_MEM_ALLOC_ENABLE=1``.

:func:`huge_page_buffer` maps anonymous memory with room to start on a 2 MiB
boundary and asks the kernel (``madvise(MADV_HUGEPAGE)``) to back it with huge
pages. That is advice: with THP set to ``never`` (or memory too fragmented)
the kernel uses 4 KiB pages and nothing else changes. :func:`thp_mode` says
which mode the machine is in, so a start-up log line can tell an operator.
"""

from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

__all__ = ["HUGE_PAGE_BYTES", "huge_page_buffer", "thp_mode"]

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size

_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode() -> str:
    """The kernel's THP mode (``always``, ``madvise`` or ``never``), or ``unknown`` where it cannot be read."""
    try:
        text = _THP_ENABLED.read_text()
    except OSError:
        return "unknown"
    for word in text.split():
        if word.startswith("[") and word.endswith("]"):
            return word[1:-1]
    return "unknown"


def huge_page_buffer(nbytes: int) -> np.ndarray:
    """A zero-filled, writable ``uint8`` array of ``nbytes`` starting on a 2 MiB boundary, advised huge pages.

    The memory is mapped lazily (pages appear on first touch, as with
    ``torch.empty``) and lives as long as the returned array or any view of
    it. ``ValueError`` for ``nbytes < 1``.
    """
    if nbytes < 1:
        raise ValueError(f"nbytes must be positive, not {nbytes}")
    # Round up so the last huge page is whole: a partial one would fall back to small pages.
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    mm = mmap.mmap(-1, length + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
    whole = np.frombuffer(mm, dtype=np.uint8)  # keeps the mapping alive
    offset = (-whole.ctypes.data) % HUGE_PAGE_BYTES
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:  # Linux only; elsewhere the buffer just uses small pages
        try:
            mm.madvise(advice, offset, length)
        except OSError:  # a kernel built without THP refuses the advice; small pages then
            pass
    return whole[offset:offset + nbytes]
