"""The secondary-pool (G2) index: block hash → block id, with pins and LRU eviction.

A :class:`PoolIndex` describes a fixed pool of ``num_blocks`` slots (block ids
``0 .. num_blocks-1``). Each block is either *free* or *caches* exactly one
block hash, and each cached hash lives in exactly one block. Blocks carry a
pin count; a pinned block (count > 0) is never evicted, removed or
overwritten, so a remote reader can copy it safely.

Contracts shared by every method:

- **Hashes** are ``bytes`` of 1..32 bytes (a TensorRT-LLM/Dynamo u64 as 8
  bytes big-endian, a vLLM SHA-256 as 32). They are compared in full, length
  included: ``b"\\x00"`` and ``b"\\x00\\x00"`` are different hashes. Anything
  else raises ``TypeError`` (not bytes) or ``ValueError`` (bad length).
- **Block ids** are ints in ``range(num_blocks)``: a non-int raises
  ``TypeError``, an int outside the range ``IndexError``.
- Arguments are validated item by item, in order, before anything changes;
  the first bad item decides the exception.
- **Errors change nothing**: every method either succeeds completely or
  raises and leaves the index (pins, LRU order, counters) as it was.
- **LRU order** covers cached blocks that are *not* pinned. A block becomes
  most-recently-used when it is inserted and when its last pin is dropped
  (so a hit of ``find_and_pin`` counts as a use once it is unpinned). Blocks
  whose pins drop to zero in one ``unpin`` call join the MRU end in call
  order: unpin a prefix in reverse (tail first) if its tail should be
  evicted first.
- **Threads**: every method is atomic with respect to every other call on the
  same index, from any thread (one internal mutex). A call never waits for
  that mutex while holding the GIL, and calls of 1024 items or more release
  the GIL while they work, so other Python threads keep running. Smaller
  calls keep the GIL when the mutex is free: their work (a few µs for 128
  hashes) is shorter than handing the GIL to another thread and back.
- Pin counts are 32-bit: a call that could take one past ``2**31 - 1`` raises
  ``OverflowError`` and changes nothing.

The compiled core is the private ``remote_g2._pool_index``; the pure-Python
``tests/pool_index_reference.py`` implements the same contracts and is the
model the property tests compare against.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import TYPE_CHECKING

from remote_g2 import _pool_index
from remote_g2.errors import BlockPinnedError

if TYPE_CHECKING:
    import numpy as np
    from collections.abc import Buffer

__all__ = ["PoolIndex", "BlockPinnedError", "MAX_HASH_LEN", "MAX_BLOCKS"]

MAX_HASH_LEN: int = _pool_index.MAX_HASH_LEN
"""Longest block hash accepted, in bytes (32)."""

MAX_BLOCKS: int = _pool_index.MAX_BLOCKS
"""Largest pool size accepted (2**30 blocks)."""


class PoolIndex:
    """Hash → block index over a fixed pool of ``num_blocks`` slots.

    Raises ``TypeError`` if ``num_blocks`` is not an int and ``ValueError``
    unless ``1 <= num_blocks <= MAX_BLOCKS``. Memory: about 40 bytes per block
    with hashes of at most 8 bytes, 24 more per block once a longer hash has
    been inserted.
    """

    __slots__ = ("_index",)

    def __init__(self, num_blocks: int) -> None:
        n = operator.index(num_blocks)
        if not 1 <= n <= MAX_BLOCKS:
            raise ValueError(f"num_blocks must be in 1..{MAX_BLOCKS}, got {n}")
        self._index = _pool_index.PoolIndex(n)

    def __repr__(self) -> str:
        return f"PoolIndex(num_blocks={self.num_blocks}, cached={len(self)})"

    @property
    def num_blocks(self) -> int:
        """The pool size given at construction."""
        return self._index.num_blocks

    # -- filling -----------------------------------------------------------

    def insert(self, block_hash: bytes, block_id: int) -> None:
        """Record that block ``block_id`` now caches ``block_hash``.

        The block becomes most-recently-used. If the block cached another
        hash, that mapping is dropped; if ``block_hash`` was cached in another
        block, that block is freed (a hash lives in one block only).
        Re-inserting the same pair just refreshes its LRU position.

        Raises :class:`BlockPinnedError` (a ``ValueError``) and changes
        nothing if ``block_id`` is pinned, or if ``block_hash`` is cached in a
        different block that is pinned.
        """
        self._index.insert(block_hash, block_id)

    def insert_packed(self, buf: Buffer, ids: np.ndarray, hash_len: int = 8) -> None:
        """Bulk :meth:`insert`: hash ``i`` is ``buf[i*hash_len:(i+1)*hash_len]``.

        ``buf`` is any C-contiguous bytes-like object (``bytes``, a numpy
        ``uint8`` array, ...) of ``n * hash_len`` bytes; ``ids`` a 1-D,
        C-contiguous, native-endian int32 or int64 array of ``n`` block ids
        (numpy raises ``ValueError`` for a non-contiguous array). Equivalent to ``insert`` of each
        pair in order, all or nothing: if any pair would raise
        :class:`BlockPinnedError`, nothing is inserted. ``ValueError`` if
        ``hash_len`` is not in 1..32, the buffer size is not a multiple of it,
        or the counts differ; ``TypeError`` for a non-buffer or a wrong dtype.
        """
        self._index.insert_packed(buf, ids, hash_len)

    # -- pinning -----------------------------------------------------------

    def find_and_pin(self, hashes: Sequence[bytes]) -> list[int]:
        """Pin the blocks of the longest cached prefix of ``hashes``.

        Walks ``hashes`` in order and stops at the first one not cached;
        returns the block ids of the hashes before it (possibly ``[]``), each
        pinned once more. Finding and pinning are one atomic step: no other
        call can evict or change a block in between. The caller owns the
        returned pins and must drop them with :meth:`unpin_blocks_by_id`.
        Every hash is validated first, including those after a miss.
        """
        return self._index.find_and_pin(hashes)

    def find_and_pin_packed(self, buf: Buffer, hash_len: int = 8) -> np.ndarray:
        """:meth:`find_and_pin` over hashes packed as in :meth:`insert_packed`.

        Returns the pinned block ids as a new numpy ``int32`` array. The fast
        path: one buffer in, one array out, no per-hash Python objects.
        """
        return self._index.find_and_pin_packed(buf, hash_len)

    def pin_blocks_by_id(self, ids: Sequence[int]) -> None:
        """Pin each block in ``ids`` once more (an id listed twice, twice).

        ``ValueError`` and no change if any of them is free (holds no hash).
        """
        self._index.pin_blocks_by_id(ids)

    def unpin_blocks_by_id(self, ids: Sequence[int]) -> None:
        """Drop one pin per id in ``ids`` (an id listed twice, two pins).

        ``ValueError`` and no change if that would take any block's pin count
        below zero, counting repeats within the call. A block whose count
        reaches zero becomes most-recently-used.
        """
        self._index.unpin_blocks_by_id(ids)

    def pin_packed(self, ids: np.ndarray) -> None:
        """:meth:`pin_blocks_by_id` for a 1-D int32/int64 array (``TypeError`` otherwise)."""
        self._index.pin_packed(ids)

    def unpin_packed(self, ids: np.ndarray) -> None:
        """:meth:`unpin_blocks_by_id` for a 1-D int32/int64 array, e.g. the
        result of :meth:`find_and_pin_packed` (``TypeError`` otherwise)."""
        self._index.unpin_packed(ids)

    # -- freeing -----------------------------------------------------------

    def evict(self, n: int) -> list[tuple[bytes, int]]:
        """Free up to ``n`` least-recently-used unpinned blocks.

        Returns ``(hash, block_id)`` of each freed block, least recently used
        first; fewer than ``n`` (possibly none) when fewer are evictable.
        Never frees a pinned block. Cost is O(number freed): pinned blocks are
        not in the LRU list at all. ``ValueError`` if ``n < 0``.
        """
        return self._index.evict(n)

    def remove(self, block_hash: bytes) -> bool:
        """Free the block caching ``block_hash``.

        Returns True when a block was freed, False when the hash is not cached
        or its block is pinned (then nothing changes).
        """
        return self._index.remove(block_hash)

    # -- reading -----------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching ``block_hash``, or None. No pin, no LRU change,
        not counted in :meth:`stats`. Only stable while you hold a pin on it."""
        return self._index.lookup(block_hash)

    def pin_count(self, block_id: int) -> int:
        """Current pin count of ``block_id`` (0 for unpinned or free blocks)."""
        return self._index.pin_count(block_id)

    def __len__(self) -> int:
        """Number of cached blocks (blocks holding a hash)."""
        return len(self._index)

    def stats(self) -> dict[str, int]:
        """A consistent snapshot of the index's gauges and counters.

        Gauges: ``num_blocks``, ``cached`` (== ``len(self)``),
        ``pinned_blocks`` (blocks with pin count > 0), ``total_pins`` (sum of
        pin counts). Cumulative counters: ``hits`` (blocks returned by
        find_and_pin calls), ``misses`` (find_and_pin calls that stopped at a
        hash not cached; at most one per call, none for a full hit),
        ``inserts`` (successful insert pairs, re-inserts included),
        ``evictions`` (blocks freed by evict), ``removals`` (remove calls that
        returned True). Blocks freed because their hash moved are not counted.
        """
        return self._index.stats()
