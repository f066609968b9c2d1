"""Copy many ``(dst, src, nbytes)`` extents inside this process, with the GIL released.

The host-side copies of the gathered READ path: a source rank packing a
lease's pieces into its staging region (:mod:`remote_g2.source.gather`,
:func:`pack_chunks`: chunk by chunk behind a counter a reader polls). One
call runs the whole list in C++
(``cpp_ext/extent_copy.cpp``) — a numpy gather of the same pieces runs at a
fraction of memcpy's rate — and other threads of the process keep running.

The caller vouches for every address: each range lies in memory this process
owns and keeps alive for the call, and no two extents overlap. Nothing here
can check that; the callers check ranges against the regions they own.
"""

from __future__ import annotations

import numpy as np

from remote_g2 import _extent_copy

__all__ = ["copy_extents", "pack_chunks", "as_u64"]


def as_u64(a: np.ndarray | list[int]) -> np.ndarray:
    """``a`` as a C-contiguous ``uint64`` array (no copy when it already is one)."""
    return np.ascontiguousarray(a, dtype=np.uint64)


def copy_extents(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> int:
    """Copy ``nbytes[i]`` bytes from ``src[i]`` to ``dst[i]`` for every row; the bytes copied.

    ``ValueError`` when the three are not equally long one-dimensional arrays.
    """
    dst, src, nbytes = as_u64(dst), as_u64(src), as_u64(nbytes)
    if not dst.ndim == src.ndim == nbytes.ndim == 1 or not dst.shape == src.shape == nbytes.shape:
        raise ValueError(f"copy_extents: dst {dst.shape}, src {src.shape} and nbytes {nbytes.shape} differ")
    return int(_extent_copy.copy_extents(dst, src, nbytes))


def pack_chunks(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, *, per_block: int, blocks: int,
                chunk_blocks: int, counter_addr: int, stop_addr: int) -> int:
    """Copy ``blocks`` blocks of ``per_block`` rows each, ``chunk_blocks`` at a time, counting them; blocks counted.

    After each chunk the u64 at ``counter_addr`` is set (release store) to
    the blocks copied so far; the u64 at ``stop_addr`` is read (acquire)
    before each chunk and before each count, and once it is non-zero
    nothing more is copied or counted. One call, the GIL released throughout
    (``cpp_ext/extent_copy.cpp``).
    """
    dst, src, nbytes = as_u64(dst), as_u64(src), as_u64(nbytes)
    return int(_extent_copy.pack_chunks(dst, src, nbytes, per_block, blocks, chunk_blocks, counter_addr, stop_addr))
