"""HostPool: a rank's secondary (G2) pool in one host buffer, indexed by a PoolIndex.

Block ``b`` is bytes ``[b * block_bytes, (b + 1) * block_bytes)`` of one
``uint8`` tensor, page-locked when CUDA is available so NIXL and the GPU can
DMA from it. A :class:`~remote_g2.memory.pool_index.PoolIndex` maps block hashes to
blocks and carries the pins.

Who changes what:

* the *mapping* (which hash a block holds, the free list) changes only in
  :meth:`HostPool.store`, :meth:`~HostPool.remove` and :meth:`~HostPool.clear`,
  under the pool's lock, so those three never race one another;
* *pins* change from any thread at any time (``find_and_pin`` and friends go
  straight to the index, which is atomic on its own), so the source service's
  RPC threads never wait for a store.

The pin contract follows from the index: a pinned block is never evicted or
removed, and ``store`` writes bytes only into a block that is free in the
index (fresh from the free list or just evicted), which nobody can pin. So a
pinned block's bytes never change.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from remote_g2.errors import PoolIndexError
from remote_g2.memory.pool_index import PoolIndex

from remote_g2.memory.host_memory import huge_page_buffer, populate, thp_mode
from remote_g2.memory.secondary_pool import BlockLayout, MemoryRegion, PoolEventKind, PoolListener

__all__ = ["HostPool"]

log = logging.getLogger("remote_g2.adapters.host_pool")

BlockData = Any
"""One block's bytes for :meth:`HostPool.store`: a bytes-like object (``bytes``,
``bytearray``, ``memoryview``, a C-contiguous numpy array) or a ``torch.Tensor``
of any dtype and device, exactly ``block_bytes`` long."""


_thp_checked = False
_PREFAULT_CHUNK = 2 << 20


def _say_once_if_thp_is_off() -> None:
    global _thp_checked
    if not _thp_checked:
        _thp_checked = True
        if thp_mode() == "never":
            log.warning("transparent huge pages are off on this machine (/sys/kernel/mm/transparent_hugepage/"
                        "enabled is 'never'): G2 pools use 4 KiB pages, and NIXL reads them more slowly "
                        "(docs/operations.md, 'Huge pages')")


class HostPool:
    """A :class:`~remote_g2.memory.secondary_pool.SecondaryPool` over one host buffer.

    ``HostPool(layout)`` allocates ``layout.num_blocks * layout.block_bytes``
    bytes (uninitialised). The buffer is page-locked when CUDA is available and
    ``pin_memory`` is not False, plain host memory otherwise (``pin_memory=True``
    without CUDA logs a warning and falls back). Plain host memory is mapped
    in 2 MiB transparent huge pages unless ``huge_pages`` is False (see
    :mod:`~remote_g2.memory.host_memory`: NIXL reads it faster). ``ValueError`` if
    ``layout.block_bytes`` cannot hold ``num_layers * kv`` slabs, or if
    ``num_blocks`` exceeds :data:`~remote_g2.memory.pool_index.MAX_BLOCKS`.

    ``reserved_blocks`` keeps the last that many blocks out of the cache
    altogether: they are never stored into, evicted or found, but they lie in
    :meth:`regions`, so an engine can hand them out itself — the reference
    engine lands remote reads there (the same block ids on every TP rank)
    before storing the bytes into the cache proper. :attr:`reserved_block_ids`
    lists them.

    Every method is thread-safe; see the module docstring for what may run
    concurrently with what.
    """

    def __init__(self, layout: BlockLayout, *, pin_memory: bool | None = None, reserved_blocks: int = 0,
                 huge_pages: bool = True) -> None:
        if not 0 <= reserved_blocks < layout.num_blocks:
            raise ValueError(f"reserved_blocks={reserved_blocks} must be in 0..{layout.num_blocks - 1} "
                             f"(the cache needs at least one block)")
        need = layout.num_layers * layout.kv * layout.slab_bytes
        if layout.block_bytes < need:
            raise ValueError(f"block_bytes {layout.block_bytes} < {need} "
                             f"(num_layers * kv * slab_bytes = {layout.num_layers} * {layout.kv} * {layout.slab_bytes})")
        # The index validates num_blocks; build it before allocating a buffer sized by it.
        self._index = PoolIndex(layout.num_blocks)
        self._layout = layout
        cuda = torch.cuda.is_available()
        if pin_memory and not cuda:
            log.warning("pin_memory=True but CUDA is not available: the pool uses plain host memory")
        nbytes = layout.num_blocks * layout.block_bytes
        self._pinned = cuda and pin_memory is not False  # page-locked: resident from the start (prefault skips it)
        if self._pinned:
            self._tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        elif huge_pages:
            self._tensor = torch.from_numpy(huge_page_buffer(nbytes))
            _say_once_if_thp_is_off()
        else:
            self._tensor = torch.empty(nbytes, dtype=torch.uint8)
        # A numpy view of the same memory: writing bytes-like data through it
        # is one memcpy, with no read-only-buffer warnings from torch.frombuffer.
        self._array = self._tensor.numpy()

        self._lock = threading.Lock()  # guards the mapping: _free, _hash_of
        # Popped from the end, so a new pool fills block 0 first; reserved blocks are never in it.
        cached_blocks = layout.num_blocks - reserved_blocks
        self._free: list[int] = list(range(cached_blocks - 1, -1, -1))
        self.reserved_block_ids = range(cached_blocks, layout.num_blocks)
        self._hash_of: dict[int, bytes] = {}  # block id -> the hash it caches

        # Listener delivery (see _deliver). Never take _lock while holding _events_lock.
        self._events_lock = threading.Lock()
        self._listeners: tuple[PoolListener, ...] = ()
        self._pending: deque[tuple[PoolEventKind, list[bytes]]] = deque()
        self._delivering = False
        self._prefault_stop = threading.Event()
        self.prefaulted_bytes = 0  # how much of the buffer prefault() has faulted in so far
        self._prefault_thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"HostPool(num_blocks={self._layout.num_blocks}, block_bytes={self._layout.block_bytes}, cached={len(self)})"

    # -- memory ------------------------------------------------------------

    @property
    def layout(self) -> BlockLayout:
        """The layout given at construction."""
        return self._layout

    @property
    def tensor(self) -> torch.Tensor:
        """The whole pool as one 1-D ``uint8`` tensor (block ``b`` at ``b * block_bytes``)."""
        return self._tensor

    def prefault(self, *, background: bool = True) -> threading.Thread | None:
        """Fault the buffer's pages in ahead of use, in the order the blocks are handed out.

        Plain host memory is taken on first touch, and a first touch costs a
        page fault and the kernel's zeroing, paid inside whatever writes the
        block first: a remote READ landing in a reserved block, a save
        storing into a fresh one (see :mod:`remote_g2.memory.host_memory`). This
        moves that cost to start-up: the reserved blocks first, then the
        cache from block 0 up (the free list's order). Nothing is written, so
        it may run while the pool is in use. ``background`` runs it in a daemon
        thread (returned; :meth:`stop_prefault` ends it early); otherwise it
        returns when done. Page-locked (CUDA) memory is resident already:
        None, nothing done. :attr:`prefaulted_bytes` counts progress.
        """
        if self._pinned:
            return None
        size = self._layout.block_bytes
        base = self._tensor.data_ptr()
        cached = self.reserved_block_ids.start  # the reserved blocks are the last ones
        spans = [(base + cached * size, len(self.reserved_block_ids) * size), (base, cached * size)]

        def run() -> None:
            t0 = time.monotonic()
            for addr, nbytes in spans:
                # small chunks: each holds the process's memory map for reading, and a thread that maps
                # memory meanwhile (an allocation) waits for the chunk to end
                done = populate(addr, nbytes, chunk_bytes=_PREFAULT_CHUNK, stop=self._prefault_stop)
                self.prefaulted_bytes += done
                if done < nbytes:
                    break
            total = self._tensor.numel()
            if self.prefaulted_bytes < total and not self._prefault_stop.is_set():
                log.info("G2 pool: faulted in %.0f of %.0f MiB ahead of use; the kernel does not offer "
                         "MADV_POPULATE_WRITE, or memory ran short", self.prefaulted_bytes / 2**20, total / 2**20)
            else:
                log.info("G2 pool: %.0f MiB faulted in ahead of use in %.1f s", self.prefaulted_bytes / 2**20,
                         time.monotonic() - t0)

        if not background:
            run()
            return None
        thread = threading.Thread(target=run, name="remote-g2-pool-prefault", daemon=True)
        thread.start()
        self._prefault_thread = thread
        return thread

    @property
    def prefaulting(self) -> bool:
        """Whether a background :meth:`prefault` is still running."""
        return self._prefault_thread is not None and self._prefault_thread.is_alive()

    def stop_prefault(self) -> None:
        """End a background :meth:`prefault` at its next chunk."""
        self._prefault_stop.set()

    def regions(self) -> list[MemoryRegion]:
        """One DRAM region covering the whole buffer (what NIXL registers)."""
        return [MemoryRegion(base=self._tensor.data_ptr(), nbytes=self._tensor.numel())]

    def block_view(self, block_id: int) -> torch.Tensor:
        """A ``uint8`` view (no copy) of block ``block_id``'s ``block_bytes`` bytes.

        For reading, and for writing a block that holds no hash. Writing a
        cached block through it bypasses the pin contract: a reader may be
        copying it. ``TypeError`` for a non-int, ``IndexError`` out of range.
        """
        b = operator.index(block_id)
        if not 0 <= b < self._layout.num_blocks:
            raise IndexError(f"block id {b} outside 0..{self._layout.num_blocks - 1}")
        size = self._layout.block_bytes
        return self._tensor[b * size:(b + 1) * size]

    # -- filling and freeing (the engine side) -------------------------------

    def store(self, hashes: Sequence[bytes], data: Sequence[BlockData] | None = None) -> list[int]:
        """Cache ``hashes`` (``data[i]`` the bytes of ``hashes[i]``); return their block ids in order.

        A hash already cached keeps its block, its bytes are not rewritten
        (equal hashes mean equal contents, and a reader may hold a pin on it)
        and it only counts as used. A new hash takes a free block, or else the
        least-recently-used unpinned block, which is evicted and reported as
        ``"removed"``. Its bytes are written before it enters the index, so no
        reader can find a block whose bytes are not there yet. With
        ``data=None`` nothing is written (the bytes are whatever the block
        held: only for tests and index-only benchmarks).

        LRU order: the blocks of one call are used tail first, so the call's
        last hash is the first of them to be evicted later. A prefix lookup
        stops at its first miss, so losing a chain's head would strand the rest.

        One call never evicts a block holding one of its own hashes. When no
        block is left for a new hash (every other block is pinned, or the call
        has more distinct hashes than the pool has unpinned blocks) it raises
        :class:`~remote_g2.errors.PoolIndexError`: the hashes before that one
        are stored (and reported), that hash and the new ones after it are
        not (cached ones stay cached), and no block is left half-written.

        Validation comes first and changes nothing: ``TypeError``/``ValueError``
        for a bad hash (see :class:`~remote_g2.memory.pool_index.PoolIndex`), ``ValueError``
        if ``data`` does not have one item of exactly ``block_bytes`` per hash.
        Listeners get ``("removed", evicted)`` then ``("stored", new_hashes)``.
        """
        hashes = list(hashes)
        sources = None if data is None else self._data_sources(hashes, data)
        events: list[tuple[PoolEventKind, list[bytes]]] = []
        try:
            with self._lock:
                try:
                    return self._store_locked(hashes, sources, events)
                finally:
                    self._enqueue(events)
        finally:
            self._deliver()

    def remove(self, hashes: Sequence[bytes]) -> int:
        """Free the blocks caching ``hashes``; return how many were freed.

        Hashes that are not cached, and hashes whose block is pinned, are
        skipped (a pinned block is never removed). Listeners get
        ``("removed", freed_hashes)``.
        """
        with self._lock:
            went = []
            for h in hashes:
                b = self._index.lookup(h)
                if b is not None and self._index.remove(h):
                    self._release(b)
                    went.append(h)
            self._enqueue([("removed", went)])
        self._deliver()
        return len(went)

    def clear(self) -> int:
        """Free every unpinned block; return how many were freed.

        Pinned blocks stay. Listeners get ``("cleared", freed_hashes)`` when
        the pool ended up empty, and ``("removed", freed_hashes)`` when pinned
        blocks stayed: "cleared" tells a mirror (the registry) to forget every
        hash of this pool, which would hide the blocks that are still here.
        """
        with self._lock:
            went = []
            for b, h in list(self._hash_of.items()):
                if self._index.remove(h):
                    self._release(b)
                    went.append(h)
            if went:
                self._enqueue([("removed" if self._hash_of else "cleared", went)])
        self._deliver()
        return len(went)

    # -- pins (the source side; straight to the index, never waits for a store) --

    def find_and_pin(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``, each pinned once more (atomic).

        The caller owns the pins and drops them with :meth:`unpin_blocks_by_id`.
        """
        return self._index.find_and_pin(hashes)

    def pin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        """Pin each block once more; all-or-nothing (``ValueError`` if one is free).

        Meant for blocks the caller already holds a pin on: an id whose pin
        was dropped may have been reused for another hash since.
        """
        self._index.pin_blocks_by_id(block_ids)

    def unpin_blocks_by_id(self, block_ids: Sequence[int]) -> None:
        """Drop one pin from each block; ``ValueError`` and no change if one is not pinned."""
        self._index.unpin_blocks_by_id(block_ids)

    def pin_count(self, block_id: int) -> int:
        """Current pin count of ``block_id`` (0 when unpinned or free)."""
        return self._index.pin_count(block_id)

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching ``block_hash`` or None; no pin, so only stable while you hold one."""
        return self._index.lookup(block_hash)

    # -- observing ---------------------------------------------------------

    def block_hashes(self) -> list[bytes]:
        """Every hash cached now, in no particular order (the registry resync snapshot)."""
        with self._lock:
            return list(self._hash_of.values())

    def __len__(self) -> int:
        """Number of cached blocks."""
        return len(self._index)

    def stats(self) -> dict[str, int]:
        """The index's gauges and counters (see :meth:`~remote_g2.memory.pool_index.PoolIndex.stats`)."""
        return self._index.stats()

    def add_listener(self, listener: PoolListener) -> None:
        """Call ``listener(kind, hashes)`` after every change to the pool's contents.

        ``kind`` is ``"stored"``, ``"removed"`` (evicted or removed) or
        ``"cleared"``; ``hashes`` is a list the listener must not keep
        mutating. Calls happen after the change, outside the pool's locks, one
        at a time and in the order the changes happened, so a mirror built
        from them is exact. A listener may call back into the pool; events its
        calls cause are delivered after it returns. Because delivery is
        serialised, a call's events may be delivered by a concurrent caller's
        thread, after that call returned. A listener that raises is logged and
        does not stop the others. Only events after this call are delivered.
        """
        with self._events_lock:
            self._listeners = (*self._listeners, listener)

    # -- internals ---------------------------------------------------------

    def _store_locked(self, hashes: list[bytes], sources: list[Any] | None,
                      events: list[tuple[PoolEventKind, list[bytes]]]) -> list[int]:
        # 1. Where each distinct hash stands; the index validates every hash here, before any change.
        first: dict[bytes, int] = {}  # distinct hash -> its first position in the call
        cached: dict[bytes, int] = {}  # distinct hash -> its block, for hashes cached already
        for i, h in enumerate(hashes):
            b = self._index.lookup(h)
            if h not in first:
                first[h] = i
                if b is not None:
                    cached[h] = b
        new = [h for h in first if h not in cached]

        # 2. Pin the call's cached blocks so the eviction below cannot take them.
        #    Nobody else frees blocks while we hold the lock, so the lookups still hold.
        self._index.pin_blocks_by_id(list(cached.values()))
        ours = dict(cached)  # the pins of step 2 not dropped yet
        try:
            blocks = self._take_blocks(len(new), events)
            placed = dict(zip(new, blocks))  # the first len(blocks) new hashes get a block
            try:
                # 3. Bytes first: these blocks are free in the index, so nobody can find or pin them.
                if sources is not None:
                    for h, b in placed.items():
                        self._write(b, sources[first[h]])
            except BaseException:
                self._free.extend(reversed(blocks))
                raise
            # 4. Publish, tail first: an insert and a last unpin both make a block most-recently-used.
            for h in reversed(first):
                if h in placed:
                    self._index.insert(h, placed[h])  # cannot fail: block free, hash in no block
                    self._hash_of[placed[h]] = h
                elif h in ours:
                    self._index.unpin_blocks_by_id([ours.pop(h)])
        finally:
            if ours:  # only when something above raised
                self._index.unpin_blocks_by_id(list(ours.values()))
        if placed:
            events.append(("stored", list(placed)))
        if len(placed) < len(new):
            stop = first[new[len(placed)]]
            raise PoolIndexError(f"pool is full: every block is pinned or holds an earlier hash of this "
                                 f"call; stored the first {stop} of {len(hashes)} hashes")
        return [placed[h] if h in placed else cached[h] for h in hashes]

    def _take_blocks(self, n: int, events: list[tuple[PoolEventKind, list[bytes]]]) -> list[int]:
        """Up to ``n`` blocks free in the index: the free list first, then LRU evictions."""
        blocks = [self._free.pop() for _ in range(min(n, len(self._free)))]
        if len(blocks) < n:
            evicted = self._index.evict(n - len(blocks))
            for _, b in evicted:
                del self._hash_of[b]
                blocks.append(b)
            if evicted:
                events.append(("removed", [h for h, _ in evicted]))
        return blocks

    def _release(self, block_id: int) -> None:
        del self._hash_of[block_id]
        self._free.append(block_id)

    def _data_sources(self, hashes: list[bytes], data: Sequence[BlockData]) -> list[Any]:
        """``data`` checked and turned into copyable sources (1-D uint8), one per hash."""
        if len(data) != len(hashes):
            raise ValueError(f"{len(data)} data items for {len(hashes)} hashes")
        size = self._layout.block_bytes
        out: list[Any] = []
        for i, item in enumerate(data):
            if isinstance(item, torch.Tensor):
                src = item.detach().contiguous().reshape(-1)
                if src.dtype != torch.uint8:
                    src = src.view(torch.uint8)
            else:
                src = np.frombuffer(memoryview(item).cast("B"), dtype=np.uint8)
            nbytes = src.numel() if isinstance(src, torch.Tensor) else src.size
            if nbytes != size:
                raise ValueError(f"data[{i}] is {nbytes} bytes, a block is {size}")
            out.append(src)
        return out

    def _write(self, block_id: int, src: Any) -> None:
        size = self._layout.block_bytes
        off = block_id * size
        if isinstance(src, torch.Tensor):
            self._tensor[off:off + size].copy_(src)
        else:
            self._array[off:off + size] = src

    def _enqueue(self, events: list[tuple[PoolEventKind, list[bytes]]]) -> None:
        # Called under _lock, so the queue's order is the order of the changes.
        with self._events_lock:
            if self._listeners:
                self._pending.extend(e for e in events if e[1])

    def _deliver(self) -> None:
        """Hand queued events to the listeners, unless another thread is already doing so.

        One deliverer at a time keeps events in order; it drains until the
        queue is empty, so an event queued while it runs is not stranded (the
        emptiness check and giving up the role are one step under _events_lock).
        """
        with self._events_lock:
            if self._delivering or not self._pending:
                return
            self._delivering = True
        try:
            while True:
                with self._events_lock:
                    if not self._pending:
                        self._delivering = False
                        return
                    kind, hashes = self._pending.popleft()
                    listeners = self._listeners
                for listener in listeners:
                    try:
                        listener(kind, hashes)
                    except Exception:
                        log.exception("pool listener %r failed on %r of %d hashes", listener, kind, len(hashes))
        except BaseException:
            with self._events_lock:
                self._delivering = False
            raise
