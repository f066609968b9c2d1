"""Pure-Python reference for :class:`remote_g2.memory.pool_index.PoolIndex` (a test oracle, not part of the package).

Same API and same contracts (see :mod:`remote_g2.memory.pool_index`), built the
straightforward way: a dict from hash to block, per-block lists, an
``OrderedDict`` as the LRU list of unpinned cached blocks, and one
``threading.Lock``. It serves two purposes:

- the model the property tests compare the C++ index against, step by step;
- the baseline of ``bench/memory/bench_pool_index.py``, so it is written to be
  reasonably fast (locals bound in hot loops, no per-call allocation beyond
  the result), not as a strawman.

Where the contracts leave room, it takes the simplest correct route rather
than copying the C++ one (e.g. ``insert_packed`` rolls back from a snapshot
instead of pre-checking), so the two can disagree if either is wrong. One
known difference: Python ints do not overflow, so pin counts here have no
``2**31 - 1`` ceiling.
"""

from __future__ import annotations

import operator
import threading
from collections import OrderedDict
from collections.abc import Iterable

import numpy as np

from remote_g2.errors import BlockPinnedError

__all__ = ["ReferencePoolIndex"]

MAX_HASH_LEN = 32
MAX_BLOCKS = 1 << 30


def _checked_hashes(hashes: Iterable[bytes]) -> list[bytes]:
    hashes = hashes if type(hashes) is list else list(hashes)
    for h in hashes:
        if type(h) is not bytes or not 0 < len(h) <= MAX_HASH_LEN:
            _check_hash(h)  # raises the precise error
    return hashes


def _check_hash(h: object) -> None:
    if not isinstance(h, bytes):
        raise TypeError(f"block hash must be bytes, not {type(h).__name__}")
    if not 0 < len(h) <= MAX_HASH_LEN:
        raise ValueError(f"block hash must be 1..32 bytes, got {len(h)}")


def _checked_id(x: object, n: int) -> int:
    i = x if type(x) is int else operator.index(x)
    if not 0 <= i < n:
        raise IndexError(f"block id {i} out of range for a pool of {n} blocks")
    return i


def _checked_ids(ids: Iterable[int], n: int) -> list[int]:
    out = []
    append = out.append
    for x in ids:
        if type(x) is not int or not 0 <= x < n:
            x = _checked_id(x, n)
        append(x)
    return out


def _unpacked_hashes(buf: object, hash_len: int) -> list[bytes]:
    if not 1 <= hash_len <= MAX_HASH_LEN:
        raise ValueError(f"hash_len must be 1..32, got {hash_len}")
    data = memoryview(buf).tobytes()  # TypeError for a non-buffer
    if len(data) % hash_len:
        raise ValueError(f"packed hashes: {len(data)} bytes is not a multiple of {hash_len}")
    return [data[i:i + hash_len] for i in range(0, len(data), hash_len)]


def _unpacked_ids(arr: object, n: int) -> list[int]:
    mv = memoryview(arr)  # TypeError for a non-buffer
    fmt = mv.format.lstrip("@=")
    if mv.ndim != 1 or (fmt, mv.itemsize) not in {("i", 4), ("l", 4), ("l", 8), ("q", 8)}:
        raise TypeError(f"block ids must be a 1-D int32 or int64 array, got format "
                        f"{mv.format!r} with ndim {mv.ndim}")
    return _checked_ids(mv.tolist(), n)


class ReferencePoolIndex:
    """Pure-Python twin of :class:`remote_g2.memory.pool_index.PoolIndex`."""

    def __init__(self, num_blocks: int) -> None:
        n = operator.index(num_blocks)
        if not 1 <= n <= MAX_BLOCKS:
            raise ValueError(f"num_blocks must be in 1..{MAX_BLOCKS}, got {n}")
        self._n = n
        self._block_of: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * n
        self._pins = [0] * n
        # Cached, unpinned blocks; first = least recently used.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._lock = threading.Lock()
        self._pinned_blocks = 0
        self._total_pins = 0
        self._hits = self._misses = self._inserts = self._evictions = self._removals = 0

    @property
    def num_blocks(self) -> int:
        return self._n

    # -- filling -----------------------------------------------------------

    def insert(self, block_hash: bytes, block_id: int) -> None:
        _check_hash(block_hash)
        b = _checked_id(block_id, self._n)
        with self._lock:
            self._check_insert(block_hash, b)
            self._apply_insert(block_hash, b)

    def insert_packed(self, buf: object, ids: object, hash_len: int = 8) -> None:
        hashes = _unpacked_hashes(buf, hash_len)
        blocks = _unpacked_ids(ids, self._n)
        if len(hashes) != len(blocks):
            raise ValueError(f"{len(hashes)} hashes but {len(blocks)} block ids")
        with self._lock:
            saved = (dict(self._block_of), list(self._hash_of), OrderedDict(self._lru),
                     self._inserts)
            try:
                for h, b in zip(hashes, blocks):
                    self._check_insert(h, b)
                    self._apply_insert(h, b)
            except BlockPinnedError:
                self._block_of, self._hash_of, self._lru, self._inserts = saved
                raise

    def _check_insert(self, h: bytes, b: int) -> None:
        pins = self._pins
        if pins[b]:
            raise BlockPinnedError(f"block {b} is pinned; cannot insert over it")
        old = self._block_of.get(h)
        if old is not None and pins[old]:
            raise BlockPinnedError(f"the hash is cached in pinned block {old}")

    def _apply_insert(self, h: bytes, b: int) -> None:
        self._inserts += 1
        old = self._block_of.get(h)
        if old == b:
            self._lru.move_to_end(b)
            return
        if old is not None:
            self._drop(old)
        if self._hash_of[b] is not None:
            self._drop(b)
        self._block_of[h] = b
        self._hash_of[b] = h
        self._lru[b] = None

    def _drop(self, b: int) -> bytes:
        h = self._hash_of[b]
        self._hash_of[b] = None
        del self._block_of[h]
        del self._lru[b]
        return h

    # -- pinning -----------------------------------------------------------

    def find_and_pin(self, hashes: Iterable[bytes]) -> list[int]:
        hashes = _checked_hashes(hashes)
        ids: list[int] = []
        with self._lock:
            get = self._block_of.get
            append = ids.append
            for h in hashes:
                b = get(h)
                if b is None:
                    self._misses += 1
                    break
                append(b)
            self._pin_all(ids)
            self._hits += len(ids)
        return ids

    def find_and_pin_packed(self, buf: object, hash_len: int = 8) -> np.ndarray:
        return np.array(self.find_and_pin(_unpacked_hashes(buf, hash_len)), dtype=np.int32)

    def pin_blocks_by_id(self, ids: Iterable[int]) -> None:
        ids = _checked_ids(ids, self._n)
        with self._lock:
            hash_of = self._hash_of
            for b in ids:
                if hash_of[b] is None:
                    raise ValueError(f"block {b} holds no hash and cannot be pinned")
            self._pin_all(ids)

    def unpin_blocks_by_id(self, ids: Iterable[int]) -> None:
        ids = _checked_ids(ids, self._n)
        with self._lock:
            pins = self._pins
            lru = self._lru
            for i, b in enumerate(ids):
                if not pins[b]:
                    # Undo the first i unpins; re-pinning unlinks exactly the
                    # blocks this call linked, so the LRU order is restored.
                    self._total_pins -= i
                    self._pin_all(ids[:i])
                    raise ValueError(f"block {b} is not pinned")
                pins[b] -= 1
                if not pins[b]:
                    lru[b] = None  # most recently used
                    self._pinned_blocks -= 1
            self._total_pins -= len(ids)

    def pin_packed(self, ids: object) -> None:
        self.pin_blocks_by_id(_unpacked_ids(ids, self._n))

    def unpin_packed(self, ids: object) -> None:
        self.unpin_blocks_by_id(_unpacked_ids(ids, self._n))

    def _pin_all(self, ids: list[int]) -> None:
        pins = self._pins
        lru = self._lru
        for b in ids:
            if not pins[b]:
                del lru[b]
                self._pinned_blocks += 1
            pins[b] += 1
        self._total_pins += len(ids)

    # -- freeing -----------------------------------------------------------

    def evict(self, n: int) -> list[tuple[bytes, int]]:
        n = operator.index(n)
        if n < 0:
            raise ValueError("evict: n must be >= 0")
        out: list[tuple[bytes, int]] = []
        with self._lock:
            lru = self._lru
            hash_of = self._hash_of
            block_of = self._block_of
            while len(out) < n and lru:
                b, _ = lru.popitem(last=False)
                h = hash_of[b]
                hash_of[b] = None
                del block_of[h]
                out.append((h, b))
            self._evictions += len(out)
        return out

    def remove(self, block_hash: bytes) -> bool:
        _check_hash(block_hash)
        with self._lock:
            b = self._block_of.get(block_hash)
            if b is None or self._pins[b]:
                return False
            self._drop(b)
            self._removals += 1
            return True

    # -- reading -----------------------------------------------------------

    def lookup(self, block_hash: bytes) -> int | None:
        _check_hash(block_hash)
        with self._lock:
            return self._block_of.get(block_hash)

    def pin_count(self, block_id: int) -> int:
        b = _checked_id(block_id, self._n)
        with self._lock:
            return self._pins[b]

    def __len__(self) -> int:
        with self._lock:
            return len(self._block_of)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "num_blocks": self._n,
                "cached": len(self._block_of),
                "pinned_blocks": self._pinned_blocks,
                "total_pins": self._total_pins,
                "hits": self._hits,
                "misses": self._misses,
                "inserts": self._inserts,
                "evictions": self._evictions,
                "removals": self._removals,
            }
