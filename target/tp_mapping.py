"""Which bytes each target rank reads, from which source rank, to where.

Pure computation, no I/O: given what a source's ``resolve`` returned (per-rank
block ids) and its per-rank :class:`~remote_g2.protocol.messages.RankInfo`, and the
target's own layout, pool address and destination block ids, :func:`plan_reads`
returns one target rank's :class:`ReadPlan`: for every source rank it reads
from, the exact ``(remote address, local address, nbytes)`` extents, coalesced.
The transfer adapter only executes these lists, one READ per (request, source
rank).

How target rank ``r`` maps onto the source (``h_s`` / ``h_t`` are kv heads per
rank on the source / target; the block layout is documented on
:class:`~remote_g2.protocol.messages.BlockLayout`)::

    same TP               source rank r, whole blocks
    target TP > source    k = tgt/src; source rank r // k, its heads
      ("split_heads")     [(r % k) * h_t, (r % k + 1) * h_t) -> the whole target slab;
                          one extent per (block, layer, k-or-v)
    source TP > target    k = src/tgt; source ranks r*k + j for j < k, each whole
      ("gather_heads")    slab -> target heads [j * h_s, (j + 1) * h_s) of that slab
    MLA (replicated KV)   one source rank, (r + mla_offset) % source_tp, whole blocks

A head slice is contiguous only in a head-major slab, so heterogeneous TP needs
``HND`` on both sides (a side with one head per rank is head-major whatever its
``order`` says). With MLA, the target reads from one source rank, but the
lease still pins every source rank and is released once, by the client.

Extents are coalesced exactly: two extents merge only when both the remote and
the local ranges are adjacent (so consecutive block ids on both sides make one
descriptor, whatever order the hashes listed them in). Block padding
(``block_bytes`` beyond the slabs) is never read, so padded pools do not merge
across blocks.

Validation comes before any address is computed (:mod:`.layout_compat`):
:func:`plan_reads` raises :class:`ValueError` with the reason a pairing cannot
be served, also for bad block ids.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NamedTuple

import numpy as np

from remote_g2 import _read_plan
from remote_g2.tp.head_slices import HeadSlice, head_slices, plan_mode, slice_pieces, source_ranks_for
from remote_g2.protocol.messages import BlockLayout, GatherSlot, RankBlocks, RankInfo

from .layout_compat import check_compatible, check_layout, check_tp, layout_shape
from .read_plan import ReadPlan, SourceReads, frozen

__all__ = [
    "HeadSlice",
    "plan_mode",
    "head_slices",
    "source_ranks_for",
    "plan_reads",
    "ReadPlanner",
]

_ADDR_LIMIT = 1 << 64  # descriptors are u64 (address, length) pairs
#: Whole-block plans (homogeneous TP, MLA) go through the compiled ``_read_plan`` (see
#: ``ReadPlanner._plan_compiled``); False plans them with numpy like the rest (benchmarks and tests compare).
COMPILED_WHOLE_BLOCK_PLANS = True


# --------------------------------------------------------------------------
# The rank mapping
# --------------------------------------------------------------------------


# HeadSlice, plan_mode, head_slices and source_ranks_for live in remote_g2/tp/head_slices.py: the source's
# gather (source/gather.py) stages exactly the pieces a slice names, so both sides share one mapping.


# --------------------------------------------------------------------------
# Planning
# --------------------------------------------------------------------------


def _by_rank(kind: str, items: Iterable, tp: int, optional: Iterable[int] = ()) -> list:
    """``items`` by their ``.rank`` (each rank once); a rank in ``optional`` may be missing (None then)."""
    out: list = [None] * tp
    for item in items:
        r = item.rank
        if not isinstance(r, (int, np.integer)) or not 0 <= r < tp:
            raise ValueError(f"{kind}: rank {r!r} outside the source's TP size {tp}")
        if out[r] is not None:
            raise ValueError(f"{kind}: rank {r} listed twice")
        out[r] = item
    missing = [r for r, item in enumerate(out) if item is None and r not in optional]
    if missing:
        raise ValueError(f"{kind}: no entry for source rank(s) {missing}")
    return out


def _ids(what: str, ids: Sequence[int], num_blocks: int) -> np.ndarray:
    count = len(ids)
    if count == 0:
        return np.empty(0, dtype=np.uint64)
    a = np.asarray(ids)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{what}: block ids must be integers")
    s = np.sort(a)  # one sort answers both checks: the range (its ends) and repeats (equal neighbours)
    if s[0] < 0 or s[-1] >= num_blocks:
        bad = next(int(x) for x in a.tolist() if not 0 <= x < num_blocks)
        raise ValueError(f"{what}: block id {bad} outside 0..{num_blocks - 1}")
    same = s[1:] == s[:-1]
    if same.any():
        raise ValueError(f"{what}: block id {int(s[1:][same][0])} listed twice")
    return a.astype(np.uint64)


def plan_reads(*, source_tp: int, source_ranks: Sequence[RankInfo], source_blocks: Sequence[RankBlocks],
               target_layout: BlockLayout, target_base: int, dst_block_ids: Sequence[int], target_tp: int,
               target_rank: int, is_mla: bool = False, mla_offset: int = 0) -> ReadPlan:
    """The reads ``target_rank`` issues to load the matched blocks into ``dst_block_ids``.

    ``source_ranks`` / ``source_blocks``: one entry per source rank (any
    order; matched by ``.rank``), as ``get_metadata``/``resolve`` returned
    them; ``source_blocks[r].block_ids[i]`` holds the i-th matched hash.
    ``target_layout`` is this rank's layout (kv heads per rank), its pool
    starting at address ``target_base``; ``dst_block_ids[i]`` receives the
    i-th matched hash (the same ids on every target rank). ``is_mla`` is both
    sides' ``LayoutFingerprint.is_mla``; ``mla_offset`` rotates which source
    rank an MLA target rank reads from (e.g. a hash of the target worker id,
    so that TP=1 targets do not all read source rank 0).

    Raises :class:`ValueError` with the reason when the layouts or TP sizes are
    incompatible (:func:`check_compatible`) or a block id or list is wrong;
    nothing is planned then. One call is ``ReadPlanner(...).plan(...)``; a
    rank that plans many loads from one source keeps the :class:`ReadPlanner`.
    """
    planner = ReadPlanner(source_tp=source_tp, source_ranks=source_ranks, target_layout=target_layout,
                          target_base=target_base, target_tp=target_tp, target_rank=target_rank, is_mla=is_mla,
                          mla_offset=mla_offset)
    return planner.plan(source_blocks, dst_block_ids)


class _SliceGeometry(NamedTuple):
    """One head slice with everything its extents need but the block ids (see :func:`_slice_extents`)."""

    source_rank: int
    agent_name: str
    src_base: np.uint64
    src_block_bytes: np.uint64
    src_off: np.ndarray | None  # per-slab offsets inside a block; None: the whole block is one extent
    dst_off: np.ndarray | None
    extent_bytes: int
    staging_base: int  # the source rank's staging region: a GatherSlot must lie inside it
    staging_bytes: int


class ReadPlanner:
    """:func:`plan_reads` in two steps: what one source epoch and this target rank fix, then each request.

    The constructor takes everything but the block ids, checks it (raising
    :class:`ValueError` with the same reasons :func:`plan_reads` gives) and
    precomputes each head slice's offsets; :meth:`plan` then only checks and
    maps block ids. Why: a target rank plans every load from a source with
    the same source ranks and layout, and on a 2-vCPU host the checks cost
    more than the mapping, right on the path from resolve to READ.
    """

    def __init__(self, *, source_tp: int, source_ranks: Sequence[RankInfo], target_layout: BlockLayout,
                 target_base: int, target_tp: int, target_rank: int, is_mla: bool = False,
                 mla_offset: int = 0) -> None:
        reason = check_tp(source_tp, target_tp)
        if reason:
            raise ValueError(reason)
        if not isinstance(target_rank, (int, np.integer)) or not 0 <= target_rank < target_tp:
            raise ValueError(f"target rank {target_rank!r} outside TP size {target_tp}")
        infos: list[RankInfo] = _by_rank("source rank info", source_ranks, source_tp)
        first = infos[0].layout
        reason = check_compatible(first, source_tp, target_layout, target_tp, is_mla=is_mla)
        if reason:
            raise ValueError(reason)
        for info in infos:
            if layout_shape(info.layout) != layout_shape(first):
                raise ValueError(f"source ranks disagree on the block layout: rank {info.rank} has {info.layout}, "
                                 f"rank 0 has {first}")
            reason = check_layout(f"source rank {info.rank}", info.layout)
            if reason:
                raise ValueError(reason)
            if info.layout.num_blocks * info.layout.block_bytes > info.pool_bytes:
                raise ValueError(f"source rank {info.rank}: {info.layout.num_blocks} blocks of "
                                 f"{info.layout.block_bytes} B exceed its pool of {info.pool_bytes} B")
            if info.pool_base + info.pool_bytes > _ADDR_LIMIT:
                raise ValueError(f"source rank {info.rank}: pool region ends past the 64-bit address space")
        if not isinstance(target_base, int) or target_base < 0 or \
                target_base + target_layout.num_blocks * target_layout.block_bytes > _ADDR_LIMIT:
            raise ValueError(f"target pool at {target_base!r} does not fit the 64-bit address space")
        self.source_tp, self.target_tp, self.target_rank = source_tp, target_tp, int(target_rank)
        self.target_layout, self.target_base = target_layout, target_base
        self.mode = plan_mode(source_tp, target_tp, is_mla=is_mla)
        self._num_blocks = [info.layout.num_blocks for info in infos]
        slices = head_slices(self.target_rank, source_tp=source_tp, target_tp=target_tp,
                             source_heads=first.num_kv_heads, target_heads=target_layout.num_kv_heads,
                             is_mla=is_mla, mla_offset=mla_offset)
        self._slices = tuple(_slice_geometry(sl, infos[sl.source_rank], target_layout) for sl in slices)
        self._whole_blocks = all(g.src_off is None for g in self._slices)
        # Source ranks no slice reads from: the compiled path checks their ids on their own (plan_whole_blocks
        # checks the ids of the ranks it reads).
        self._unread_ranks = tuple(sorted(set(range(source_tp)) - {g.source_rank for g in self._slices}))

    def plan(self, source_blocks: Sequence[RankBlocks], dst_block_ids: Sequence[int]) -> ReadPlan:
        """This rank's reads of one request (``source_blocks``, ``dst_block_ids`` as for :func:`plan_reads`).

        ``source_blocks`` may leave out the source ranks this rank does not
        read from (a share resolved with its peer rank alone); those given are
        checked all the same.
        """
        blocks: list[RankBlocks | None] = _by_rank("source blocks", source_blocks, self.source_tp,
                                                   optional=self._unread_ranks)
        count = len(dst_block_ids)
        for b in blocks:
            if b is not None and len(b.block_ids) != count:
                raise ValueError(f"source rank {b.rank}: {len(b.block_ids)} block ids for {count} destination blocks")
        staged = {g.source_rank: _slot_for(blocks[g.source_rank], self.target_rank) for g in self._slices}
        if count and self._whole_blocks and COMPILED_WHOLE_BLOCK_PLANS and not any(staged.values()):
            compiled = self._plan_compiled(blocks, dst_block_ids, count)
            if compiled is not None:
                return compiled
        tgt = self.target_layout
        dst = _ids("destination", dst_block_ids, tgt.num_blocks)
        src_ids = [None if b is None else _ids(f"source rank {r}", b.block_ids, self._num_blocks[r])
                   for r, b in enumerate(blocks)]
        reads = []
        if count:
            u = np.uint64
            dst_start = u(self.target_base) + dst * u(tgt.block_bytes)
            for g in self._slices:
                slot = staged[g.source_rank]
                if slot is not None:
                    remote, local, nbytes, chunk = _staged_extents(g, slot, count, dst_start)
                    remote, local, nbytes, chunk = _coalesce(remote, local, nbytes, chunk)
                    need = np.minimum((chunk + u(1)) * u(slot.chunk_blocks), u(count))
                    reads.append(SourceReads(g.source_rank, g.agent_name, frozen(remote), frozen(local),
                                             frozen(nbytes), slot.ready_addr, frozen(need)))
                    continue
                remote, local, nbytes = _slice_extents(g, src_ids[g.source_rank], dst_start)
                remote, local, nbytes, _ = _coalesce(remote, local, nbytes)
                reads.append(SourceReads(g.source_rank, g.agent_name, frozen(remote), frozen(local),
                                         frozen(nbytes)))
        return self._read_plan(reads, count)

    def _read_plan(self, reads: list[SourceReads], count: int) -> ReadPlan:
        reads.sort(key=lambda r: r.source_rank)
        return ReadPlan(target_rank=self.target_rank, mode=self.mode, num_blocks=count, reads=tuple(reads))

    def _plan_compiled(self, blocks: list[RankBlocks | None], dst_block_ids: Sequence[int], count: int) -> ReadPlan | None:
        """:meth:`plan` for whole-block extents in one compiled call per slice; None: let the array path answer.

        Why: a rank plans right after a message woke it, and on this kind of
        host code that ran before a sleep runs several times slower once
        after it; the price scales with the code run (``bench/diagnostics/bench_wake_cost.py``).
        The numpy path makes ~20 calls; the two compared:
        ``bench_wake_cost.py --plan-path both`` (docs/benchmarks.md, "Wake
        cost"). Anything unusual — ids that are not a list of
        plain ints, out of range, repeated — goes to the array path, which
        raises the reason (or, for numpy integer ids, plans them).
        """
        tgt = self.target_layout
        for r in self._unread_ranks:  # every rank's ids given, read or not, as the array path checks them
            b = blocks[r]
            if b is not None and not _read_plan.ids_ok(b.block_ids, self._num_blocks[r]):
                return None
        reads = []
        for g in self._slices:
            out = _read_plan.plan_whole_blocks(blocks[g.source_rank].block_ids, int(g.src_base),
                                               int(g.src_block_bytes), self._num_blocks[g.source_rank],
                                               dst_block_ids, self.target_base, tgt.block_bytes, tgt.num_blocks,
                                               g.extent_bytes)
            if out is None:
                return None
            remote, local, nbytes = out
            reads.append(SourceReads(g.source_rank, g.agent_name, frozen(remote), frozen(local), frozen(nbytes)))
        return self._read_plan(reads, count)


def _slice_geometry(sl: HeadSlice, info: RankInfo, tgt: BlockLayout) -> _SliceGeometry:
    src = info.layout
    u = np.uint64
    src_off, piece_bytes = slice_pieces(src, sl, tgt.num_kv_heads)
    if src_off is None:  # both slab runs are contiguous inside a block: one extent per block
        return _SliceGeometry(sl.source_rank, info.agent_name, u(info.pool_base), u(src.block_bytes), None, None,
                              piece_bytes, info.staging_base, info.staging_bytes)
    per_head = src.tokens_per_block * src.head_dim * src.dtype_bytes
    dst_off = np.arange(src_off.shape[0], dtype=u) * u(tgt.slab_bytes) + u(sl.target_lo * per_head)
    return _SliceGeometry(sl.source_rank, info.agent_name, u(info.pool_base), u(src.block_bytes), src_off, dst_off,
                          piece_bytes, info.staging_base, info.staging_bytes)


def _slice_extents(g: _SliceGeometry, src_ids: np.ndarray, dst_start: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Uncoalesced extents of one head slice for every matched block, block-major then slab."""
    src_start = g.src_base + src_ids * g.src_block_bytes
    if g.src_off is None or g.dst_off is None:
        return src_start, dst_start, np.full(src_start.shape[0], g.extent_bytes, dtype=np.uint64)
    remote = (src_start[:, None] + g.src_off[None, :]).ravel()
    local = (dst_start[:, None] + g.dst_off[None, :]).ravel()
    return remote, local, np.full(remote.shape[0], g.extent_bytes, dtype=np.uint64)


def _slot_for(blocks: RankBlocks | None, target_rank: int) -> GatherSlot | None:
    """The part source rank ``blocks.rank`` staged for ``target_rank`` (None: read it in place)."""
    if blocks is None:
        return None
    return next((s for s in blocks.staged if s.target_rank == target_rank), None)


def _staged_extents(g: _SliceGeometry, slot: GatherSlot, count: int, dst_start: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Extents of one head slice read from where its source rank staged it (source/gather.py's packing),
    with the staging chunk each belongs to (extents of two chunks are never merged: one may be staged first).

    The slot must be exactly what this slice's pieces make, and lie inside the
    rank's staging region; anything else is a source this target cannot
    trust to hold the right bytes (``ValueError``: the load fails, and is recomputed).
    """
    u = np.uint64
    per_block = 1 if g.src_off is None else int(g.src_off.shape[0])
    stride = per_block * g.extent_bytes
    if slot.block_stride != stride:
        raise ValueError(f"source rank {g.source_rank} staged blocks {slot.block_stride} B apart, this target's "
                         f"slice packs {stride} B")
    if slot.blocks < count:
        raise ValueError(f"source rank {g.source_rank} staged {slot.blocks} blocks of {count}")
    end = g.staging_base + g.staging_bytes
    if slot.addr < g.staging_base or slot.addr + count * stride > end or \
            not g.staging_base <= slot.ready_addr <= end - 8 or slot.ready_addr % 8:
        raise ValueError(f"source rank {g.source_rank} staged outside its staging region")
    remote = ((u(slot.addr) + np.arange(count, dtype=u) * u(stride))[:, None]
              + np.arange(per_block, dtype=u)[None, :] * u(g.extent_bytes)).ravel()
    local = dst_start if g.dst_off is None else (dst_start[:, None] + g.dst_off[None, :]).ravel()
    chunk = np.repeat(np.arange(count, dtype=u) // u(slot.chunk_blocks), per_block)
    return remote, local, np.full(remote.shape[0], g.extent_bytes, dtype=u), chunk


def _coalesce(remote: np.ndarray, local: np.ndarray, nbytes: np.ndarray, group: np.ndarray | None = None
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Sort by remote address and merge each extent into the previous one when both sides are adjacent
    (and, with ``group``, both are of one group); the group of each merged extent comes back too."""
    if remote.shape[0] <= 1:
        return remote, local, nbytes, group
    order = np.argsort(remote, kind="stable")
    remote, local, nbytes = remote[order], local[order], nbytes[order]
    joins = (remote[:-1] + nbytes[:-1] == remote[1:]) & (local[:-1] + nbytes[:-1] == local[1:])
    if group is not None:
        group = group[order]
        joins &= group[:-1] == group[1:]
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    if starts.shape[0] == remote.shape[0]:
        return remote, local, nbytes, group
    return remote[starts], local[starts], np.add.reduceat(nbytes, starts), None if group is None else group[starts]
