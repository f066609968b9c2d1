"""host_memory: huge-page buffers, and faulting memory in ahead of use without changing a byte."""

from __future__ import annotations

import ctypes
import mmap
import threading

import numpy as np
import pytest

from remote_g2.memory.host_memory import HUGE_PAGE_BYTES, huge_page_buffer, populate

MIB = 1 << 20


def resident(addr: int, nbytes: int) -> int:
    """How many of the pages of ``[addr, addr + nbytes)`` are in memory now (the kernel's mincore)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = addr - addr % page
    pages = -(-(addr + nbytes - start) // page)
    vec = (ctypes.c_ubyte * pages)()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(pages * page), vec) == 0, ctypes.get_errno()
    return sum(v & 1 for v in vec)


def test_huge_page_buffer_is_aligned_zeroed_and_lazy():
    buf = huge_page_buffer(8 * MIB + 123)
    assert buf.size == 8 * MIB + 123 and buf.ctypes.data % HUGE_PAGE_BYTES == 0
    assert not buf[:: 4096].any()


def test_populate_faults_a_fresh_buffer_in():
    buf = huge_page_buffer(32 * MIB)
    before = resident(buf.ctypes.data, buf.size)
    done = populate(buf.ctypes.data, buf.size, chunk_bytes=4 * MIB)
    if done == 0:
        pytest.skip("this kernel does not offer MADV_POPULATE_WRITE (Linux < 5.14)")
    assert done == buf.size
    pages = buf.size // mmap.PAGESIZE
    assert before < pages  # first touch had not happened: the check below can fail
    assert resident(buf.ctypes.data, buf.size) == pages


def test_populate_changes_no_byte_of_memory_in_use():
    buf = huge_page_buffer(16 * MIB)
    rng = np.random.default_rng(3)
    written = rng.integers(0, 256, size=5 * MIB, dtype=np.uint8)
    buf[3 * MIB:8 * MIB] = written  # some pages in use, the rest untouched
    stop = threading.Event()
    writer_err: list[BaseException] = []

    def writer() -> None:  # a thread writing the buffer while it is populated
        try:
            for i in range(200):
                buf[10 * MIB + i * 4096:10 * MIB + i * 4096 + 16] = i % 256
        except BaseException as e:  # pragma: no cover - reported below
            writer_err.append(e)
        stop.set()

    t = threading.Thread(target=writer)
    t.start()
    # an unaligned start: the page holding the first byte is populated, nothing before it changes
    assert populate(buf.ctypes.data + 100, buf.size - 100, chunk_bytes=1 * MIB) in (0, buf.size - 100)
    t.join()
    assert not writer_err
    assert np.array_equal(buf[3 * MIB:8 * MIB], written)
    assert not buf[:3 * MIB].any() and not buf[8 * MIB:10 * MIB].any()
    assert all(int(buf[10 * MIB + i * 4096]) == i % 256 for i in range(200))


def test_populate_stops_between_chunks_and_refuses_bad_sizes():
    buf = huge_page_buffer(8 * MIB)
    stop = threading.Event()
    stop.set()
    assert populate(buf.ctypes.data, buf.size, stop=stop) == 0
    assert populate(buf.ctypes.data, 0) == 0
    with pytest.raises(ValueError):
        populate(buf.ctypes.data, -1)
    with pytest.raises(ValueError):
        populate(buf.ctypes.data, 10, chunk_bytes=0)
