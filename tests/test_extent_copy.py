"""copy_extents: every extent copied byte for byte, in any order, and bad shapes refused before a byte moves."""

from __future__ import annotations

import numpy as np
import pytest

from remote_g2.memory.extent_copy import copy_extents, pack_chunks


def test_scattered_pieces_are_packed_and_unpacked_byte_for_byte():
    rng = np.random.default_rng(7)
    pool = rng.integers(0, 256, 1 << 20, dtype=np.uint8)
    packed = np.zeros(256 * 1024, dtype=np.uint8)
    ids = rng.permutation(256)[:64].astype(np.uint64)  # 64 scattered 4 KiB blocks of 256
    base, out = np.uint64(pool.ctypes.data), np.uint64(packed.ctypes.data)
    piece = np.uint64(4096)
    n = copy_extents(out + np.arange(64, dtype=np.uint64) * piece, base + ids * piece, np.full(64, 4096))
    assert n == 64 * 4096
    for i, b in enumerate(ids.tolist()):
        assert np.array_equal(packed[i * 4096:(i + 1) * 4096], pool[b * 4096:(b + 1) * 4096])

    back = np.zeros_like(pool)
    copy_extents(np.uint64(back.ctypes.data) + ids * piece, out + np.arange(64, dtype=np.uint64) * piece,
                 np.full(64, 4096))
    mask = np.zeros(256, dtype=bool)
    mask[ids.astype(np.int64)] = True
    assert np.array_equal(back.reshape(256, 4096)[mask], pool.reshape(256, 4096)[mask])
    assert not back.reshape(256, 4096)[~mask].any()  # nothing outside the extents was written


def test_uneven_lengths_and_empty_lists():
    src = np.arange(100, dtype=np.uint8)
    dst = np.zeros(100, dtype=np.uint8)
    s, d = np.uint64(src.ctypes.data), np.uint64(dst.ctypes.data)
    assert copy_extents(np.array([d, d + np.uint64(50)]), np.array([s + np.uint64(10), s]), np.array([3, 7])) == 10
    assert dst[:3].tolist() == [10, 11, 12] and dst[50:57].tolist() == list(range(7))
    assert copy_extents(np.empty(0), np.empty(0), np.empty(0)) == 0


def test_mismatched_lengths_are_refused():
    with pytest.raises(ValueError, match="differ"):
        copy_extents(np.zeros(2), np.zeros(3), np.zeros(2))


def test_pack_chunks_counts_each_chunk_and_stops_at_the_stop_word():
    src = np.arange(10 * 64, dtype=np.uint8)
    dst = np.zeros_like(src)
    words = np.zeros(2, dtype=np.uint64)  # [counter, stop]
    u = np.uint64
    rows = np.arange(20, dtype=u)  # 10 blocks of 2 rows of 32 bytes
    args = (u(dst.ctypes.data) + rows * u(32), u(src.ctypes.data) + rows * u(32), np.full(20, 32, dtype=u))
    counter, stop = words.ctypes.data, words.ctypes.data + 8
    assert pack_chunks(*args, per_block=2, blocks=7, chunk_blocks=3, counter_addr=counter, stop_addr=stop) == 7
    assert int(words[0]) == 7 and np.array_equal(dst[:7 * 64], src[:7 * 64]) and not dst[7 * 64:].any()
    dst[:] = 0
    words[:] = (0, 1)
    assert pack_chunks(*args, per_block=2, blocks=10, chunk_blocks=3, counter_addr=counter, stop_addr=stop) == 0
    assert int(words[0]) == 0 and not dst.any()
    with pytest.raises(ValueError):
        pack_chunks(*args, per_block=2, blocks=11, chunk_blocks=3, counter_addr=counter, stop_addr=stop)
    with pytest.raises(ValueError):
        pack_chunks(*args, per_block=2, blocks=1, chunk_blocks=1, counter_addr=counter + 4, stop_addr=stop)
