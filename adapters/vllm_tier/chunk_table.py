"""The holder's chunk table: which row holds which chunk, in memory a reader READs one-sided.

A fetch that asks the holder over RPC pays two thread wake-ups on each side
of each call (ZMQ's I/O threads, the holder's RPC thread, the GIL) before its
READ starts. Where a reader's READs need no progress from the holder (a
``cma`` READ on one host, RDMA across hosts: source/progress_pace.py), it
can find the rows itself: the holder keeps this table in a region its NIXL
agent registers beside the primary region, and the reader READs the table's
buckets for its chunks, then the rows, then the slots again.

**Layout.** ``buckets × WAYS`` slots of :data:`SLOT_BYTES` (one cache line)
each; a chunk's slot is one of the :data:`WAYS` of bucket
``int.from_bytes(digest[:8], "little") & (buckets - 1)``. A slot is::

    version  u64   even: stable; odd: being written
    digest   32 B  the chunk's hash (or its BLAKE2b-256 when it is not 32 bytes)
    row      u32   the primary row holding it
    (20 bytes of padding)

A slot whose digest is all zeros is free. A chunk that finds its bucket full
is simply not in the table: the reader's RPC resolve still finds it.

**Validation (a seqlock).** The writer (the scheduler thread only) makes a
slot's version odd, writes its fields, then makes it even again; it clears a
chunk's slot the same way when the primary evicts or removes the chunk,
which happens before vLLM hands the row to another chunk (serving.py). A
reader READs the slot, READs the row, then READs the slot again: the bytes
stand only if the slot is unchanged and its version even. A slot read torn
(mid-write) shows an odd version, or a version that differs from the second
read's, since the writer's first store of an update is the version's.
Stores are issued in program order by one thread; x86 keeps them in that
order (on weakly ordered hosts the lock round-trip between the stores is
the fence).
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np

__all__ = ["SLOT_BYTES", "WAYS", "ChunkTable", "bucket_of", "digest_of", "find_in_buckets", "slot_dtype"]

SLOT_BYTES = 64
WAYS = 4
_FREE = bytes(32)

#: For each bitmask of a bucket's ways in use, its first free way (-1: none).
_FIRST_FREE = [next((w for w in range(WAYS) if not taken >> w & 1), -1) for taken in range(1 << WAYS)]

def _row_word(index: int) -> int:
    """Where slot ``index``'s row is among the table's 32-bit words (after its version and digest: word 10)."""
    return index * (SLOT_BYTES // 4) + 10


#: One slot (see the module docstring).
slot_dtype = np.dtype([("version", "<u8"), ("digest", "V32"), ("row", "<u4"), ("pad", "V20")])
assert slot_dtype.itemsize == SLOT_BYTES


def digest_of(chunk_hash: bytes) -> bytes:
    """The 32 bytes a slot keys ``chunk_hash`` by: the hash itself when it is 32 bytes, else its BLAKE2b-256."""
    h = bytes(chunk_hash)
    if len(h) == 32 and h != _FREE:
        return h
    return hashlib.blake2b(h, digest_size=32, person=b"rg2-tier-slot").digest()


def bucket_of(digest: bytes, buckets: int) -> int:
    """The bucket a digest lives in (``buckets`` is a power of two)."""
    return int.from_bytes(digest[:8], "little") & (buckets - 1)


def find_in_buckets(buckets: np.ndarray, digests: list[bytes]) -> list[tuple[int, int, int] | None]:
    """For each digest, ``(way, version, row)`` of its slot in its bucket as READ (``buckets``: ``slot_dtype``,
    one row of ways per digest), or None: not there, or there mid-write (an odd version: taken as absent)."""
    if not digests:
        return []
    n, ways = buckets.shape
    words = buckets.view(np.uint64).reshape(n, ways, SLOT_BYTES // 8)  # (version, digest x 4, row | pad, ...)
    want = np.frombuffer(b"".join(digests), np.uint64).reshape(n, 1, 4)
    match = (words[:, :, 1:5] == want).all(axis=2)  # (n, ways)
    way = match.argmax(axis=1)
    at = np.arange(n)
    versions = words[at, way, 0].tolist()
    rows = (words[at, way, 5] & 0xFFFFFFFF).tolist()  # (little-endian: the row is the low half of word 5)
    return [(w, v, r) if ok and not v & 1 else None
            for w, v, r, ok in zip(way.tolist(), versions, rows, match[at, way].tolist())]


class ChunkTable:
    """The writer's side: a page-aligned table of ``buckets`` buckets (a power of two, at least twice the rows:
    a bucket then holds half a chunk on average, and one of ``WAYS`` slots overflows rarely), written from one
    thread (the scheduler's). :attr:`base`/:attr:`nbytes` is the memory to register with the agent (512 bytes
    a row: nothing beside a row's KV bytes)."""

    def __init__(self, num_rows: int) -> None:
        buckets = 1
        while buckets < 2 * max(1, num_rows):
            buckets *= 2
        self.buckets = buckets
        self.nbytes = buckets * WAYS * SLOT_BYTES
        raw = np.zeros(self.nbytes + 4096, np.uint8)
        raw.fill(0)  # (faults its pages in now, not one by one on the scheduler thread's first stores)
        offset = (-raw.ctypes.data) % 4096
        self._raw = raw  # (keeps the allocation alive: the slots are a view into it)
        flat = raw[offset:offset + self.nbytes]
        self.slots = flat.view(slot_dtype)
        self.base = int(self.slots.ctypes.data)
        # The writer's views of the same bytes (a numpy scalar store costs several times more than a memoryview
        # item's): the words (a slot's version is word 8 * index), the 32-bit words (its row is 16 * index + 10),
        # and the bytes its digest goes to.
        self._bytes = memoryview(flat)
        self._words = self._bytes.cast("Q")
        self._words32 = self._bytes.cast("I")
        self._where: dict[bytes, int] = {}  # digest -> its slot index
        self._taken = bytearray(buckets)  # per bucket, a bit per way in use (no READ of the slots to find one)
        self._fence = threading.Lock()
        self.overflowed = 0  # chunks whose bucket was full (served over RPC only)

    def put(self, chunk_hash: bytes, row: int) -> bool:
        """``chunk_hash`` is held in ``row`` now; False if its bucket is full (it is then not in the table)."""
        d = digest_of(chunk_hash)
        index = self._where.get(d)
        if index is not None and self._words32[_row_word(index)] == row:
            return True  # (stored again where it was: readers in flight stay good)
        if index is None:
            bucket = bucket_of(d, self.buckets)
            taken = self._taken[bucket]
            way = _FIRST_FREE[taken]
            if way < 0:
                self.overflowed += 1
                return False
            self._taken[bucket] = taken | 1 << way
            index = bucket * WAYS + way
        self._write(index, d, row)
        self._where[d] = index
        return True

    def drop(self, chunk_hash: bytes) -> None:
        """``chunk_hash`` left the primary: its slot is cleared (before its row can hold anything else)."""
        index = self._where.pop(digest_of(chunk_hash), None)
        if index is not None:
            self._write(index, _FREE, 0)
            bucket, way = divmod(index, WAYS)
            self._taken[bucket] &= ~(1 << way) & 0xFF

    def clear(self) -> None:
        """Every chunk left (the primary was reset)."""
        for index in list(self._where.values()):
            self._write(index, _FREE, 0)
        self._where.clear()
        self._taken = bytearray(self.buckets)

    def __len__(self) -> int:
        return len(self._where)

    def _write(self, index: int, digest: bytes, row: int) -> None:
        words, at = self._words, index * (SLOT_BYTES // 8)
        version = words[at]
        words[at] = version + 1  # odd: a reader that sees this, or a later version, drops what it read
        with self._fence:
            pass
        self._bytes[at * 8 + 8:at * 8 + 40] = digest
        self._words32[_row_word(index)] = row
        with self._fence:
            pass
        words[at] = version + 2
