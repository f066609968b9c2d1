"""Stage a lease's bytes packed, per target rank, so that a reader READs a few long runs instead of many pieces.

Why: a READ costs per descriptor (``bench/diagnostics/bench_descriptor_cost.py``),
and two kinds of load have many small ones — a target of another TP size
reads one piece per (block, layer, K/V) head slice, and small blocks
scattered through the pool are one descriptor each. Copying those pieces
into one run on the source, in the order the reader wants them, costs a
memcpy per piece and saves a descriptor per piece on the READ (seed 002's
bounce buffer, on the host side).

What a source rank does when a resolve (``resolve``, ``sibling_resolve``,
``sibling_pin`` or ``peer_resolve``) carries a
:class:`~remote_g2.protocol.messages.GatherWish`, right after it pinned its share:
for every target rank that reads from it
(:func:`remote_g2.tp.head_slices.head_slices`; only the wish's
``target_rank`` when it names one: a target rank's own ``peer_resolve``), the pieces that rank reads of
each pinned block (:func:`~remote_g2.tp.head_slices.slice_pieces`). A target
rank's part is staged when

* its direct READ would take at least ``min_descriptors`` descriptors
  (a piece merged with the one before it where it follows it in the pool,
  as the reader's planner merges them),
  of at most ``max_piece_bytes`` each on average — larger pieces already
  move at the link's rate, and the copy would only add to them; and
* the staging region has room for it (else it is read in place: staging
  is a budget, never a reason to fail).

Pipelined: the resolve takes a range of the rank's
:class:`~remote_g2.source.staging.StagingArena` for the part (owned by the
lease), zeroes its staged-blocks counter and answers at once with a
:class:`~remote_g2.protocol.messages.GatherSlot`; this rank's gather thread then
packs the part chunk by chunk (``chunk_bytes``), block by block, each
block's pieces back to back, and after each chunk stores how many leading
blocks are staged (after a release fence: a reader that sees the count sees
the bytes). A reader READs the counter and then the chunks it covers, so
the READ of chunk k overlaps the packing of chunk k+1. Target ranks that
read the same pieces (MLA) share one range. A gather stops at the next chunk
when its lease ends, and a chunk copied while the lease ended is never
counted (its pins may have gone mid-copy); the range is freed then, never
while it is written.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from remote_g2.memory.extent_copy import pack_chunks
from remote_g2.tp.head_slices import head_slices, slice_pieces
from remote_g2.protocol.messages import BlockLayout, GatherSlot, GatherWish

from .staging import StagingArena

__all__ = ["Gatherer", "GATHER_OUTCOMES"]

log = logging.getLogger("remote_g2.source.gather")

#: Per target rank part: staged, read in place (few or large descriptors), no room in the staging
#: region, the lease ended during the copy, or a wish this rank cannot serve (other heads or TP).
GATHER_OUTCOMES = ("staged", "direct", "no_room", "lease_gone", "unservable")


@dataclass(slots=True)
class _Job:
    """One part to pack: piece ``i`` of the part goes from ``src[i]`` to ``dst[i]``; ``per_block`` per block."""

    lease_id: int
    addr: int
    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    per_block: int
    blocks: int
    chunk_blocks: int
    ready_addr: int


class Gatherer:
    """One source rank's gathers into its staging region (see the module docstring); :meth:`close` stops it."""

    def __init__(self, arena: StagingArena, *, rank: int, source_tp: int, layout: BlockLayout, pool_base: int,
                 min_descriptors: int, max_piece_bytes: int, chunk_bytes: int = 2 << 20,
                 observe: Callable[[str, int, float], None] | None = None) -> None:
        self.arena = arena
        self.rank = rank
        self.source_tp = source_tp
        self.layout = layout
        self.pool_base = pool_base
        self.min_descriptors = min_descriptors
        self.max_piece_bytes = max_piece_bytes
        self.chunk_bytes = chunk_bytes
        self._observe = observe or (lambda outcome, nbytes, seconds: None)
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"source-gather-tp{rank}", daemon=True)
        self._thread.start()

    def stage(self, lease_id: int, block_ids: Sequence[int], wish: GatherWish | None) -> list[GatherSlot]:
        """Start staging what ``wish``'s target ranks read of ``block_ids`` (this rank's pins of ``lease_id``)."""
        if wish is None or not block_ids or self._closed:
            return []
        try:
            return self._stage(lease_id, block_ids, wish)
        except Exception:  # a bug here must cost a gather, never the resolve or its pins
            log.exception("lease %d: gathering on rank %d failed; reading in place", lease_id, self.rank)
            self.arena.release(lease_id)
            return []

    def close(self) -> None:
        """Stop the gather thread after the job it is on (the arena's busy ranges are settled); idempotent."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)
        self._thread.join(10)

    def _stage(self, lease_id: int, block_ids: Sequence[int], wish: GatherWish) -> list[GatherSlot]:
        reason = self._unservable(wish)
        if reason:
            log.debug("lease %d: not gathering on rank %d: %s", lease_id, self.rank, reason)
            self._observe("unservable", 0, 0.0)
            return []
        lay = self.layout
        u = np.uint64
        ids = np.asarray(block_ids, dtype=u)
        starts = u(self.pool_base) + ids * u(lay.block_bytes)
        slots: list[GatherSlot] = []
        staged: dict[tuple[int, int], GatherSlot] = {}  # (head lo, head hi) -> its slot: shared ranges
        readers = range(wish.target_tp) if wish.target_rank is None else (wish.target_rank,)
        for target_rank in readers:
            for sl in head_slices(target_rank, source_tp=self.source_tp, target_tp=wish.target_tp,
                                  source_heads=lay.num_kv_heads, target_heads=wish.target_heads,
                                  is_mla=wish.is_mla, mla_offset=wish.mla_offset):
                if sl.source_rank != self.rank:
                    continue
                key = (sl.source_lo, sl.source_hi)
                if key not in staged:
                    offsets, piece = slice_pieces(lay, sl, wish.target_heads)
                    slot = self._start_part(lease_id, starts, offsets, piece)
                    if slot is None:
                        continue
                    staged[key] = slot
                slots.append(replace(staged[key], target_rank=target_rank))
        return slots

    def _unservable(self, wish: GatherWish) -> str | None:
        lay = self.layout
        if wish.target_rank is not None and wish.target_rank >= wish.target_tp:
            return f"target rank {wish.target_rank} of a TP-{wish.target_tp} reader"
        if wish.is_mla:
            return None if wish.target_heads == lay.num_kv_heads else "MLA with another number of heads"
        src_heads, tgt_heads = self.source_tp * lay.num_kv_heads, wish.target_tp * wish.target_heads
        if src_heads != tgt_heads:
            return f"the target has {tgt_heads} kv heads in all, this worker {src_heads}"
        big, small = max(self.source_tp, wish.target_tp), min(self.source_tp, wish.target_tp)
        if big % small:
            return f"TP {self.source_tp} -> {wish.target_tp} is not an integer ratio"
        if wish.target_tp > self.source_tp and lay.order != "HND" and lay.num_kv_heads > 1:
            return "a head slice of an NHD layout is not contiguous"
        return None

    def _start_part(self, lease_id: int, starts: np.ndarray, offsets: np.ndarray | None,
                    piece: int) -> GatherSlot | None:
        """Take a range for one part, zero its counter and queue its packing; None: read it in place."""
        u = np.uint64
        n = starts.shape[0]
        src = starts if offsets is None else (starts[:, None] + offsets[None, :]).ravel()
        descriptors = _runs(src, piece)
        if descriptors < self.min_descriptors or src.shape[0] * piece > descriptors * self.max_piece_bytes:
            self._observe("direct", 0, 0.0)
            return None
        per_block = 1 if offsets is None else offsets.shape[0]
        stride = piece * per_block
        data = -(-stride * n // 8) * 8
        addr = self.arena.take(lease_id, data + 8)
        if addr is None:
            self._observe("no_room", 0, 0.0)
            return None
        ready = addr + data
        chunk = max(1, self.chunk_bytes // stride)
        try:
            self.arena.store_word(ready, 0)  # before the reply: a reader never sees an earlier lease's count
            self._jobs.put(_Job(lease_id, addr, src, u(addr) + np.arange(src.shape[0], dtype=u) * u(piece),
                                np.full(src.shape[0], piece, dtype=u), per_block, n, chunk, ready))
        except BaseException:
            self.arena.filled(lease_id, addr)  # not busy any more: the lease's release frees it
            raise
        return GatherSlot(0, addr, stride, n, ready, chunk)

    def _run(self) -> None:
        _yield_to_the_control_path()
        while (job := self._jobs.get()) is not None:
            try:
                self._pack(job)
            except Exception:  # the counter stops short: the reader's load fails at its deadline
                log.exception("lease %d: packing a staged part on rank %d failed", job.lease_id, self.rank)

    def _pack(self, job: _Job) -> None:
        arena = self.arena
        t0 = time.perf_counter()
        done = 0
        try:
            if not self._closed:
                # One call, no GIL: between chunks a Python loop would wait for the GIL behind this rank's
                # other threads (up to a switch interval, 5 ms, per chunk).
                done = pack_chunks(job.dst, job.src, job.nbytes, per_block=job.per_block, blocks=job.blocks,
                                   chunk_blocks=job.chunk_blocks, counter_addr=job.ready_addr,
                                   stop_addr=arena.stop_word(job.lease_id, job.addr))
        finally:
            kept = arena.filled(job.lease_id, job.addr)
        if done < job.blocks or not kept:
            self._observe("lease_gone", 0, time.perf_counter() - t0)
        else:
            self._observe("staged", int(job.nbytes.sum()), time.perf_counter() - t0)


#: The gather thread's nice value: packing is bulk work the resolves, renewals and releases of this rank
#: (and its NIXL progress) must not wait behind on a busy core.
GATHER_NICE = 10


def _yield_to_the_control_path() -> None:
    """Lower this thread's scheduling priority (Linux: per thread); where that is not possible, leave it."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), GATHER_NICE)
    except (AttributeError, OSError) as e:
        log.debug("gather thread keeps its priority: %s", e)


def _runs(src: np.ndarray, piece: int) -> int:
    """How many descriptors a direct READ of equal ``piece``-byte extents at ``src`` (in the reader's order)
    takes: a piece merges with the one before it only when it follows it in the pool too, since the reader's
    destinations follow the same order (a lease of a whole pool, scrambled, is still one descriptor a block)."""
    if src.shape[0] <= 1:
        return int(src.shape[0])
    return 1 + int(np.count_nonzero(src[1:] != src[:-1] + np.uint64(piece)))
