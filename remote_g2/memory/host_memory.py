"""Large host buffers backed by transparent huge pages, for memory NIXL reads: G2 pools, staging regions.

Why: on one host NIXL's UCX backend copies with cross-memory attach
(``process_vm_readv``), and over RDMA the NIC translates every page it
touches; either way the cost per 4 KiB page adds up. With the pool in 2 MiB
pages the same 64 MiB fetch runs faster end to end
(``bench/transfer/bench_transfer.py --pool-pages huge`` vs ``4k``: the "huge pages"
row of the fetch A/B table in ``docs/benchmarks.md``). NumPy already asks for huge pages for its own large
arrays; torch's CPU allocator does not unless ``THP_MEM_ALLOC_ENABLE=1``.

:func:`huge_page_buffer` maps anonymous memory with room to start on a 2 MiB
boundary and asks the kernel (``madvise(MADV_HUGEPAGE)``) to back it with huge
pages. That is advice: with THP set to ``never`` (or memory too fragmented)
the kernel uses 4 KiB pages and nothing else changes. :func:`thp_mode` says
which mode the machine is in, so a start-up log line can tell an operator.

Either way, memory is only taken on first touch, and a first touch is a page
fault plus zeroing in the kernel, paid by whichever thread writes the page
first: a READ landing in a pool block, a save copying into one. On a
virtual machine whose host also backs guest memory lazily that costs far
more than the copy itself. :func:`populate` faults a buffer in ahead of use
(``madvise(MADV_POPULATE_WRITE)``: no byte changes, so it may run while the
buffer is in use).
"""

from __future__ import annotations

import ctypes
import mmap
import threading
from pathlib import Path

import numpy as np

__all__ = ["HUGE_PAGE_BYTES", "huge_page_buffer", "populate", "thp_mode"]

HUGE_PAGE_BYTES = 2 << 20  # x86-64 and arm64 (4 KiB base pages) PMD size
_MADV_POPULATE_WRITE = 23  # Linux 5.14+; not in Python 3.11's mmap module
_PAGE = mmap.PAGESIZE

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


def _madvise() -> object | None:
    try:  # ctypes releases the GIL for the call: populating gigabytes stalls no other thread
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    fn.restype = ctypes.c_int
    return fn


def populate(addr: int, nbytes: int, *, chunk_bytes: int = 32 << 20, stop: threading.Event | None = None) -> int:
    """Fault in the pages of ``[addr, addr + nbytes)`` for writing, leaving every byte as it is.

    ``madvise(MADV_POPULATE_WRITE)``, ``chunk_bytes`` at a time (the GIL is
    released for each; ``stop`` set ends it between chunks). Safe on memory
    in use: a page already present is left alone, and no content changes.
    Returns the bytes populated: fewer than asked when ``stop`` was set, 0
    where the kernel (before 5.14) or the platform does not offer it, or
    refuses (``ENOMEM`` when memory runs short: the rest then faults in on
    first touch as before). ``ValueError`` for ``nbytes < 0`` or ``chunk_bytes < 1``.
    """
    if nbytes < 0 or chunk_bytes < 1:
        raise ValueError(f"nbytes must be >= 0 and chunk_bytes >= 1, not {nbytes}, {chunk_bytes}")
    fn = _madvise()
    if fn is None or nbytes == 0:
        return 0
    start = addr - addr % _PAGE  # the page holding the first byte is ours to fault in
    end = addr + nbytes
    chunk = max(_PAGE, chunk_bytes - chunk_bytes % _PAGE)
    at = start
    while at < end:
        if stop is not None and stop.is_set():
            break
        n = min(chunk, end - at)
        if fn(at, n, _MADV_POPULATE_WRITE) != 0:  # type: ignore[operator]
            break
        at += n
    return max(0, min(at, end) - addr)
