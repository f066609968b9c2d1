"""Unit tests for remote_g2.memory.pool_index.PoolIndex, one area per test.

Semantic tests run against both the C++ index and the pure-Python reference
(the model of the property tests), so each is checked on its own and the two
cannot drift apart silently.
"""

from __future__ import annotations

import numpy as np
import pytest

from remote_g2.errors import BlockPinnedError, PoolIndexError
from pool_index_reference import ReferencePoolIndex
from remote_g2.memory.pool_index import MAX_BLOCKS, PoolIndex


@pytest.fixture(params=[PoolIndex, ReferencePoolIndex], ids=["cpp", "reference"])
def make(request):
    return request.param


def h(i: int) -> bytes:
    """The 8-byte big-endian hash of i (the TensorRT-LLM/Dynamo form)."""
    return i.to_bytes(8, "big")


def snapshot(index, hashes) -> tuple:
    """Everything observable without changing the index."""
    return (
        index.stats(),
        len(index),
        [index.pin_count(b) for b in range(index.num_blocks)],
        {x: index.lookup(x) for x in hashes},
    )


def filled(make, n: int = 8, count: int | None = None):
    index = make(n)
    for b in range(n if count is None else count):
        index.insert(h(b), b)
    return index


# -- construction ------------------------------------------------------------


def test_new_index_is_empty(make):
    index = make(4)
    assert index.num_blocks == 4
    assert len(index) == 0
    assert index.stats() == {
        "num_blocks": 4, "cached": 0, "pinned_blocks": 0, "total_pins": 0,
        "hits": 0, "misses": 0, "inserts": 0, "evictions": 0, "removals": 0,
    }
    assert [index.pin_count(b) for b in range(4)] == [0, 0, 0, 0]
    assert index.evict(10) == []


@pytest.mark.parametrize("n", [0, -1, MAX_BLOCKS + 1])
def test_bad_pool_size_is_value_error(make, n):
    with pytest.raises(ValueError):
        make(n)


@pytest.mark.parametrize("n", ["8", 8.0, None])
def test_non_int_pool_size_is_type_error(make, n):
    with pytest.raises(TypeError):
        make(n)


def test_repr_names_size():
    assert repr(filled(PoolIndex, 4, 2)) == "PoolIndex(num_blocks=4, cached=2)"


# -- insert / lookup ---------------------------------------------------------


def test_insert_then_lookup(make):
    index = make(4)
    index.insert(h(7), 2)
    assert index.lookup(h(7)) == 2
    assert index.lookup(h(8)) is None
    assert len(index) == 1
    assert index.stats()["inserts"] == 1


def test_insert_over_other_hash_drops_old_mapping(make):
    index = make(4)
    index.insert(h(1), 0)
    index.insert(h(2), 0)
    assert index.lookup(h(1)) is None
    assert index.lookup(h(2)) == 0
    assert len(index) == 1


def test_insert_hash_into_new_block_frees_old_block(make):
    index = make(4)
    index.insert(h(1), 0)
    index.insert(h(1), 3)
    assert index.lookup(h(1)) == 3
    assert len(index) == 1
    with pytest.raises(ValueError):  # block 0 is free again: nothing to pin
        index.pin_blocks_by_id([0])
    assert index.evict(4) == [(h(1), 3)]


def test_reinsert_same_pair_refreshes_lru(make):
    index = filled(make, 3)
    index.insert(h(0), 0)
    assert [b for _, b in index.evict(3)] == [1, 2, 0]
    assert index.stats()["inserts"] == 4


def test_insert_over_pinned_block_raises_and_changes_nothing(make):
    index = filled(make, 4)
    index.pin_blocks_by_id([1])
    before = snapshot(index, [h(i) for i in range(6)])
    with pytest.raises(BlockPinnedError) as err:
        index.insert(h(5), 1)
    assert isinstance(err.value, ValueError) and isinstance(err.value, PoolIndexError)
    with pytest.raises(BlockPinnedError):
        index.insert(h(1), 1)  # even the hash it already holds
    assert snapshot(index, [h(i) for i in range(6)]) == before


def test_insert_hash_held_by_other_pinned_block_raises(make):
    index = filled(make, 4)
    index.find_and_pin([h(2)])
    before = snapshot(index, [h(i) for i in range(4)])
    with pytest.raises(BlockPinnedError):
        index.insert(h(2), 0)
    assert snapshot(index, [h(i) for i in range(4)]) == before
    # Evict order is untouched too: 0, 1, 3 (2 is pinned).
    assert [b for _, b in index.evict(4)] == [0, 1, 3]


def test_hashes_compare_in_full_including_length(make):
    # Zero padding and shared prefixes must never merge two hashes.
    keys = [b"\x00", b"\x00\x00", b"a", b"a\x00", h(1), h(1) + b"\x00",
            b"\xff" * 32, b"\xff" * 31 + b"\xfe", b"\x00" * 9, b"\x00" * 32]
    index = make(len(keys))
    for b, key in enumerate(keys):
        index.insert(key, b)
    assert [index.lookup(key) for key in keys] == list(range(len(keys)))
    assert len(index) == len(keys)
    assert sorted(index.evict(len(keys))) == sorted(zip(keys, range(len(keys))))


def test_32_byte_hashes(make):
    keys = [bytes([i]) * 32 for i in range(16)]
    index = make(16)
    for b, key in enumerate(keys):
        index.insert(key, b)
    assert index.find_and_pin(keys) == list(range(16))
    index.unpin_blocks_by_id(list(range(16)))
    assert index.remove(keys[5])
    assert index.lookup(keys[5]) is None
    assert index.evict(1) == [(keys[0], 0)]


@pytest.mark.parametrize("bad", [b"", b"x" * 33])
def test_bad_hash_length_is_value_error(make, bad):
    index = filled(make, 4)
    before = snapshot(index, [h(i) for i in range(4)])
    for call in (lambda: index.insert(bad, 0), lambda: index.lookup(bad),
                 lambda: index.remove(bad), lambda: index.find_and_pin([h(0), bad])):
        with pytest.raises(ValueError):
            call()
    assert snapshot(index, [h(i) for i in range(4)]) == before


@pytest.mark.parametrize("bad", ["abc", bytearray(b"abc"), 7, None])
def test_non_bytes_hash_is_type_error(make, bad):
    index = filled(make, 4)
    before = snapshot(index, [h(i) for i in range(4)])
    for call in (lambda: index.insert(bad, 0), lambda: index.lookup(bad),
                 lambda: index.remove(bad), lambda: index.find_and_pin([h(0), bad])):
        with pytest.raises(TypeError):
            call()
    assert snapshot(index, [h(i) for i in range(4)]) == before


@pytest.mark.parametrize("bad", [-1, 4, 2**31, 2**70, -(2**70)])
def test_out_of_range_id_is_index_error(make, bad):
    index = filled(make, 4)
    before = snapshot(index, [h(i) for i in range(4)])
    for call in (lambda: index.insert(h(9), bad), lambda: index.pin_count(bad),
                 lambda: index.pin_blocks_by_id([0, bad]),
                 lambda: index.unpin_blocks_by_id([bad])):
        with pytest.raises(IndexError):
            call()
    assert snapshot(index, [h(i) for i in range(4)]) == before


@pytest.mark.parametrize("bad", [1.0, "1", None, [1]])
def test_non_int_id_is_type_error(make, bad):
    index = filled(make, 4)
    for call in (lambda: index.insert(h(9), bad), lambda: index.pin_count(bad),
                 lambda: index.pin_blocks_by_id([0, bad]),
                 lambda: index.unpin_blocks_by_id([bad])):
        with pytest.raises(TypeError):
            call()
    assert index.pin_count(0) == 0


def test_numpy_integer_ids_are_accepted(make):
    index = make(4)
    index.insert(h(1), np.int64(3))
    index.pin_blocks_by_id([np.int32(3)])
    assert index.pin_count(np.int16(3)) == 1


def test_first_bad_item_decides_the_error(make):
    index = filled(make, 4)
    with pytest.raises(TypeError):
        index.find_and_pin([h(0), "x", b""])
    with pytest.raises(ValueError):
        index.find_and_pin([h(0), b"", "x"])
    with pytest.raises(IndexError):
        index.pin_blocks_by_id([9, "x"])
    with pytest.raises(TypeError):
        index.pin_blocks_by_id(["x", 9])


def test_lookup_does_not_touch_lru_or_stats(make):
    index = filled(make, 3)
    before = index.stats()
    assert index.lookup(h(0)) == 0
    assert index.lookup(h(99)) is None
    assert index.stats() == before
    assert [b for _, b in index.evict(1)] == [0]


# -- find_and_pin ------------------------------------------------------------


def test_find_and_pin_returns_prefix_and_stops_at_first_miss(make):
    index = filled(make, 8, count=6)
    ids = index.find_and_pin([h(3), h(1), h(77), h(2)])
    assert ids == [3, 1]
    assert [index.pin_count(b) for b in range(8)] == [0, 1, 0, 1, 0, 0, 0, 0]
    s = index.stats()
    assert (s["hits"], s["misses"], s["pinned_blocks"], s["total_pins"]) == (2, 1, 2, 2)


def test_find_and_pin_full_hit_and_empty(make):
    index = filled(make, 4)
    assert index.find_and_pin([]) == []
    assert index.find_and_pin([h(0), h(1)]) == [0, 1]
    assert index.find_and_pin([h(99)]) == []
    assert index.stats()["misses"] == 1  # the full hit and the empty call count no miss


def test_find_and_pin_repeats_pin_twice(make):
    index = filled(make, 4)
    assert index.find_and_pin([h(2), h(2)]) == [2, 2]
    assert index.pin_count(2) == 2
    assert index.stats()["pinned_blocks"] == 1


def test_find_and_pin_validates_hashes_after_a_miss(make):
    index = filled(make, 4)
    with pytest.raises(ValueError):
        index.find_and_pin([h(0), h(99), b""])
    assert index.pin_count(0) == 0
    assert index.stats()["hits"] == 0


def test_find_and_pin_accepts_tuples_and_iterables(make):
    index = filled(make, 4)
    assert index.find_and_pin((h(0), h(1))) == [0, 1]
    assert index.find_and_pin(iter([h(2)])) == [2]


def test_pinned_hits_become_mru_when_unpinned(make):
    index = filled(make, 4)
    ids = index.find_and_pin([h(0), h(1)])
    index.unpin_blocks_by_id(ids)  # 0 then 1 rejoin the MRU end in this order
    assert [b for _, b in index.evict(4)] == [2, 3, 0, 1]


# -- pin / unpin by id -------------------------------------------------------


def test_pin_and_unpin_by_id_are_symmetric(make):
    index = filled(make, 4)
    index.pin_blocks_by_id([1, 1, 2])
    assert [index.pin_count(b) for b in range(4)] == [0, 2, 1, 0]
    assert index.stats()["total_pins"] == 3
    index.unpin_blocks_by_id([1, 2])
    index.unpin_blocks_by_id([1])
    assert [index.pin_count(b) for b in range(4)] == [0, 0, 0, 0]
    s = index.stats()
    assert (s["pinned_blocks"], s["total_pins"]) == (0, 0)


def test_unpin_of_unpinned_raises_and_changes_nothing(make):
    index = filled(make, 4)
    index.pin_blocks_by_id([0, 1])
    keys = [h(i) for i in range(4)]
    before = snapshot(index, keys)
    with pytest.raises(ValueError):
        index.unpin_blocks_by_id([0, 1, 2])  # 2 is not pinned: 0 and 1 stay pinned
    assert snapshot(index, keys) == before
    with pytest.raises(ValueError):
        index.unpin_blocks_by_id([1, 1])  # the repeat would go below zero
    assert snapshot(index, keys) == before
    # The LRU list is restored too: 2 and 3 are still the only evictable blocks.
    assert [b for _, b in index.evict(4)] == [2, 3]


def test_pin_free_block_raises_and_changes_nothing(make):
    index = filled(make, 4, count=2)
    with pytest.raises(ValueError):
        index.pin_blocks_by_id([0, 3])
    assert index.pin_count(0) == 0
    assert index.stats()["total_pins"] == 0


def test_pin_and_unpin_empty_lists(make):
    index = filled(make, 2)
    index.pin_blocks_by_id([])
    index.unpin_blocks_by_id([])
    assert index.stats()["total_pins"] == 0


# -- evict / remove ----------------------------------------------------------


def test_evict_is_lru_first_and_frees_blocks(make):
    index = filled(make, 5)
    assert index.evict(2) == [(h(0), 0), (h(1), 1)]
    assert index.lookup(h(0)) is None and index.lookup(h(1)) is None
    assert len(index) == 3
    assert index.stats()["evictions"] == 2
    index.insert(h(10), 0)  # a freed block can be reused
    assert index.evict(10) == [(h(2), 2), (h(3), 3), (h(4), 4), (h(10), 0)]
    assert index.evict(1) == []


def test_evict_never_returns_a_pinned_block(make):
    index = filled(make, 6)
    index.find_and_pin([h(0), h(1)])
    index.pin_blocks_by_id([4])
    evicted = index.evict(6)
    assert [b for _, b in evicted] == [2, 3, 5]
    assert len(index) == 3
    assert index.evict(6) == []
    index.unpin_blocks_by_id([4])
    assert index.evict(6) == [(h(4), 4)]


def test_evict_zero_and_bad_counts(make):
    index = filled(make, 2)
    assert index.evict(0) == []
    with pytest.raises(ValueError):
        index.evict(-1)
    with pytest.raises(TypeError):
        index.evict(1.5)
    assert len(index) == 2


def test_remove(make):
    index = filled(make, 4)
    index.pin_blocks_by_id([1])
    assert index.remove(h(0)) is True
    assert index.remove(h(0)) is False  # absent now
    assert index.remove(h(1)) is False  # pinned
    assert index.lookup(h(1)) == 1
    assert index.remove(h(99)) is False
    assert len(index) == 3
    assert index.stats()["removals"] == 1
    assert [b for _, b in index.evict(4)] == [2, 3]


# -- packed API --------------------------------------------------------------


def test_packed_api_equals_list_api(make):
    a, b = filled(make, 64, count=48), filled(make, 64, count=48)
    rng = np.random.default_rng(1)
    for _ in range(50):
        start = int(rng.integers(0, 60))
        keys = [h(i) for i in range(start, start + int(rng.integers(0, 12)))]
        ids_list = a.find_and_pin(keys)
        ids_arr = b.find_and_pin_packed(b"".join(keys), 8)
        assert isinstance(ids_arr, np.ndarray) and ids_arr.dtype == np.int32
        assert ids_arr.tolist() == ids_list
        if rng.random() < 0.7:
            a.unpin_blocks_by_id(ids_list[::-1])
            b.unpin_packed(ids_arr[::-1].copy())
        assert a.evict(1) == b.evict(1)
        keys = [h(i) for i in range(100)]
        assert snapshot(a, keys) == snapshot(b, keys)


@pytest.mark.parametrize("wrap", [bytes, bytearray, memoryview,
                                  lambda x: np.frombuffer(x, dtype=np.uint8)])
def test_packed_hashes_accept_any_bytes_like(make, wrap):
    index = filled(make, 4)
    ids = index.find_and_pin_packed(wrap(h(1) + h(2) + h(9)), 8)
    assert ids.tolist() == [1, 2]
    assert index.stats()["misses"] == 1


def test_packed_other_hash_lengths(make):
    keys = [bytes([i]) * 32 for i in range(4)]
    index = make(4)
    index.insert_packed(b"".join(keys), np.arange(4), 32)
    assert index.find_and_pin_packed(b"".join(keys[1:]), 32).tolist() == [1, 2, 3]
    index.unpin_packed(np.array([1, 2, 3]))
    index.insert_packed(b"\x00\x01", np.array([0, 1], np.int32), 1)
    assert index.lookup(b"\x01") == 1
    assert index.find_and_pin_packed(b"", 8).tolist() == []


@pytest.mark.parametrize("hash_len", [0, 33, -8])
def test_packed_bad_hash_len_is_value_error(make, hash_len):
    index = filled(make, 4)
    with pytest.raises(ValueError):
        index.find_and_pin_packed(h(1), hash_len)
    with pytest.raises(ValueError):
        index.insert_packed(h(1), np.array([0]), hash_len)


def test_packed_bad_buffers(make):
    index = filled(make, 4)
    with pytest.raises(ValueError):
        index.find_and_pin_packed(b"x" * 9, 8)  # not a multiple of hash_len
    with pytest.raises(TypeError):
        index.find_and_pin_packed([h(1)], 8)  # not a buffer
    with pytest.raises(ValueError):
        index.insert_packed(h(1) + h(2), np.array([0]), 8)  # counts differ
    assert index.stats()["hits"] == 0 and index.stats()["inserts"] == 4


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_pin_unpin_packed(make, dtype):
    index = filled(make, 4)
    index.pin_packed(np.array([0, 3, 3], dtype))
    assert [index.pin_count(b) for b in range(4)] == [1, 0, 0, 2]
    index.unpin_packed(np.array([3, 0, 3], dtype))
    assert index.stats()["total_pins"] == 0


@pytest.mark.parametrize("bad", [np.array([0.0]), np.array([[0]]), [0], np.array([0], np.uint8),
                                 np.array(0)])
def test_packed_ids_wrong_type_is_type_error(make, bad):
    index = filled(make, 4)
    with pytest.raises(TypeError):
        index.pin_packed(bad)
    with pytest.raises(TypeError):
        index.unpin_packed(bad)
    assert index.pin_count(0) == 0


def test_packed_ids_out_of_range_and_unpinned(make):
    index = filled(make, 4)
    index.pin_packed(np.array([1]))
    with pytest.raises(IndexError):
        index.pin_packed(np.array([0, 4]))
    with pytest.raises(IndexError):
        index.unpin_packed(np.array([-1], np.int32))
    with pytest.raises(ValueError):
        index.unpin_packed(np.array([1, 1]))
    assert [index.pin_count(b) for b in range(4)] == [0, 1, 0, 0]


def test_insert_packed_equals_sequential_inserts(make):
    rng = np.random.default_rng(7)
    hashes = rng.integers(0, 40, size=200).astype(">u8")
    ids = rng.integers(0, 32, size=200)
    a, b = make(32), make(32)
    a.insert_packed(hashes.tobytes(), ids, 8)
    for x, i in zip(hashes.tolist(), ids.tolist()):
        b.insert(h(x), i)
    keys = [h(i) for i in range(40)]
    assert snapshot(a, keys) == snapshot(b, keys)
    assert a.evict(32) == b.evict(32)


def test_insert_packed_is_all_or_nothing(make):
    index = filled(make, 4)
    index.pin_blocks_by_id([3])
    keys = [h(i) for i in range(12)]
    before = snapshot(index, keys)
    with pytest.raises(BlockPinnedError):
        index.insert_packed(h(10) + h(11) + h(3), np.array([0, 1, 2]), 8)  # h(3) is pinned in 3
    with pytest.raises(BlockPinnedError):
        index.insert_packed(h(10) + h(11), np.array([0, 3]), 8)
    assert snapshot(index, keys) == before
    assert [b for _, b in index.evict(4)] == [0, 1, 2]


def test_larger_index_round_trip():
    # Enough blocks for long probe runs and table wrap-around in the C++ table.
    n = 50_000
    index = PoolIndex(n)
    hashes = np.arange(n, dtype=">u8")
    index.insert_packed(hashes.tobytes(), np.arange(n, dtype=np.int64)[::-1].copy(), 8)
    assert len(index) == n
    ids = index.find_and_pin_packed(hashes.tobytes(), 8)
    assert ids.tolist() == list(range(n - 1, -1, -1))
    index.unpin_packed(ids)
    # Remove every other hash, then every remaining one must still be found.
    for i in range(0, n, 2):
        assert index.remove(h(i))
    assert all(index.lookup(h(i)) == n - 1 - i for i in range(1, n, 2))
    assert all(index.lookup(h(i)) is None for i in range(0, n, 2))
    assert len(index) == n // 2


def test_reentrant_calls_from_argument_conversion(make):
    # Python code that runs while arguments are read (an id's __index__, a
    # generator of hashes) may call the index again and change the list being
    # read; the outer call must see a consistent view and nothing may break.
    index = filled(make, 8)
    ids: list = []

    class Sneaky:
        def __index__(self) -> int:
            index.pin_blocks_by_id([1, 2, 3])
            ids.clear()
            return 0

    ids.extend([Sneaky(), 5, 6])
    index.pin_blocks_by_id(ids)  # the list shrank to nothing after item 0
    assert [index.pin_count(b) for b in range(8)] == [1, 1, 1, 1, 0, 0, 0, 0]

    def hashes():
        yield h(4)
        assert index.find_and_pin([h(5), h(6)]) == [5, 6]
        yield h(5)

    assert index.find_and_pin(hashes()) == [4, 5]
    assert [index.pin_count(b) for b in range(8)] == [1, 1, 1, 1, 1, 2, 1, 0]
