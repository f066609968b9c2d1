"""Stage a lease's bytes packed, per target rank, so that a reader READs a few long runs instead of many pieces.

Why: a READ costs per descriptor (``bench/diagnostics/bench_descriptor_cost.py``),
and two kinds of load have many small ones — a target of another TP size
reads one piece per (block, layer, K/V) head slice, and small blocks
scattered through the pool are one descriptor each. Copying those pieces
into one run on the source, in the order the reader wants them, costs a
memcpy per piece here (fractions of a microsecond for a few KiB) and saves
a descriptor per piece on the READ (seed 002's bounce buffer, on the host side).

What a source rank does when a resolve (``resolve``, ``sibling_resolve``,
``sibling_pin`` or ``peer_resolve``) carries a
:class:`~remote_g2.messages.GatherWish`, right after it pinned its share:
for every target rank that reads from it
(:func:`remote_g2.head_slices.head_slices`), the pieces that rank reads of
each pinned block (:func:`~remote_g2.head_slices.slice_pieces`). A target
rank's part is staged when

* its direct READ would take at least ``min_descriptors`` descriptors
  (pieces adjacent in the pool merged, as the reader's planner merges them),
  of at most ``max_piece_bytes`` each on average — larger pieces already
  move at the link's rate, and the copy would only add to them; and
* the staging region has room for it (else it is read in place: staging
  is a budget, never a reason to fail).

The part is packed block by block, each block's pieces back to back
(``GatherSlot.block_stride`` apart), into a range of the rank's
:class:`~remote_g2.source.staging.StagingArena` owned by the lease; target
ranks that read the same pieces (MLA) share one range. The reply's
:class:`~remote_g2.messages.GatherSlot` s say where. The copy runs on the
handler's thread with the GIL released; a lease that ended while its part
was copied gets no slot.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np

from remote_g2.extent_copy import copy_extents
from remote_g2.head_slices import head_slices, slice_pieces
from remote_g2.messages import BlockLayout, GatherSlot, GatherWish

from .staging import StagingArena

__all__ = ["Gatherer", "GATHER_OUTCOMES"]

log = logging.getLogger("remote_g2.source.gather")

#: Per target rank part: staged, read in place (few or large descriptors), no room in the staging
#: region, the lease ended during the copy, or a wish this rank cannot serve (other heads or TP).
GATHER_OUTCOMES = ("staged", "direct", "no_room", "lease_gone", "unservable")


class Gatherer:
    """One source rank's gathers into its staging region (see the module docstring)."""

    def __init__(self, arena: StagingArena, *, rank: int, source_tp: int, layout: BlockLayout, pool_base: int,
                 min_descriptors: int, max_piece_bytes: int,
                 observe: Callable[[str, int, float], None] | None = None) -> None:
        self.arena = arena
        self.rank = rank
        self.source_tp = source_tp
        self.layout = layout
        self.pool_base = pool_base
        self.min_descriptors = min_descriptors
        self.max_piece_bytes = max_piece_bytes
        self._observe = observe or (lambda outcome, nbytes, seconds: None)

    def stage(self, lease_id: int, block_ids: Sequence[int], wish: GatherWish | None) -> list[GatherSlot]:
        """Stage what ``wish``'s target ranks read of ``block_ids`` (this rank's pins of ``lease_id``)."""
        if wish is None or not block_ids:
            return []
        try:
            return self._stage(lease_id, block_ids, wish)
        except Exception:  # a bug here must cost a gather, never the resolve or its pins
            log.exception("lease %d: gathering on rank %d failed; reading in place", lease_id, self.rank)
            self.arena.release(lease_id)
            return []

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
        staged: dict[tuple[int, int], tuple[int, int]] = {}  # (head lo, head hi) -> (addr, stride): shared ranges
        for target_rank in range(wish.target_tp):
            for sl in head_slices(target_rank, source_tp=self.source_tp, target_tp=wish.target_tp,
                                  source_heads=lay.num_kv_heads, target_heads=wish.target_heads,
                                  is_mla=wish.is_mla, mla_offset=wish.mla_offset):
                if sl.source_rank != self.rank:
                    continue
                key = (sl.source_lo, sl.source_hi)
                if key not in staged:
                    offsets, piece = slice_pieces(lay, sl, wish.target_heads)
                    done = self._stage_part(lease_id, starts, offsets, piece)
                    if done is None:
                        continue
                    staged[key] = done
                addr, stride = staged[key]
                slots.append(GatherSlot(target_rank, addr, stride, len(block_ids)))
        return slots

    def _unservable(self, wish: GatherWish) -> str | None:
        lay = self.layout
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

    def _stage_part(self, lease_id: int, starts: np.ndarray, offsets: np.ndarray | None,
                    piece: int) -> tuple[int, int] | None:
        """Pack one part into a new range of the lease; ``(addr, block stride)``, or None (read in place)."""
        u = np.uint64
        n = starts.shape[0]
        src = starts if offsets is None else (starts[:, None] + offsets[None, :]).ravel()
        descriptors = _runs(src, piece)
        if descriptors < self.min_descriptors or src.shape[0] * piece > descriptors * self.max_piece_bytes:
            self._observe("direct", 0, 0.0)
            return None
        stride = piece * (1 if offsets is None else offsets.shape[0])
        t0 = time.perf_counter()
        addr = self.arena.take(lease_id, stride * n)
        if addr is None:
            self._observe("no_room", 0, 0.0)
            return None
        try:
            copy_extents(u(addr) + np.arange(src.shape[0], dtype=u) * u(piece), src,
                         np.full(src.shape[0], piece, dtype=u))
        finally:
            kept = self.arena.filled(lease_id, addr)
        if not kept:
            self._observe("lease_gone", 0, time.perf_counter() - t0)
            return None
        self._observe("staged", stride * n, time.perf_counter() - t0)
        return addr, stride


def _runs(src: np.ndarray, piece: int) -> int:
    """How many descriptors a direct READ of equal ``piece``-byte extents at ``src`` takes, neighbours merged."""
    if src.shape[0] <= 1:
        return int(src.shape[0])
    s = np.sort(src)
    return 1 + int(np.count_nonzero(s[1:] != s[:-1] + np.uint64(piece)))
