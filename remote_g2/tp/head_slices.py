"""Which source rank's kv heads fill which heads of a target rank: the TP mapping both sides share.

Pure arithmetic on TP sizes and heads per rank (``h_s`` / ``h_t``)::

    same TP               source rank r, whole blocks
    target TP > source    k = tgt/src; source rank r // k, its heads
      ("split_heads")     [(r % k) * h_t, (r % k + 1) * h_t) -> the whole target slab
    source TP > target    k = src/tgt; source ranks r*k + j for j < k, each whole
      ("gather_heads")    slab -> target heads [j * h_s, (j + 1) * h_s) of that slab
    MLA (replicated KV)   one source rank, (r + mla_offset) % source_tp, whole blocks

The target plans its READs from it (remote_g2/target/tp_mapping.py); a
source rank asked to gather a lease (remote_g2/source/gather.py) stages
exactly the pieces of :func:`slice_pieces`, in that order, so the two sides
agree on every byte's place without sending offsets. Compatibility (equal
shapes, head-major layouts where a head slice is read) is checked elsewhere
(remote_g2/target/layout_compat.py); these functions only map.
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import numpy as np

from remote_g2.protocol.messages import BlockLayout

__all__ = ["HeadSlice", "PlanMode", "plan_mode", "head_slices", "source_ranks_for", "slice_pieces"]

PlanMode = Literal["same_tp", "split_heads", "gather_heads", "mla"]


class HeadSlice(NamedTuple):
    """Source heads ``[source_lo, source_hi)`` of ``source_rank`` land at target heads from ``target_lo``."""

    source_rank: int
    source_lo: int
    source_hi: int
    target_lo: int


def plan_mode(source_tp: int, target_tp: int, *, is_mla: bool) -> PlanMode:
    """How a target rank maps onto source ranks (no validation beyond the ordering of sizes)."""
    if is_mla:
        return "mla"
    if source_tp == target_tp:
        return "same_tp"
    return "split_heads" if target_tp > source_tp else "gather_heads"


def head_slices(target_rank: int, *, source_tp: int, target_tp: int, source_heads: int, target_heads: int,
                is_mla: bool, mla_offset: int = 0) -> tuple[HeadSlice, ...]:
    """Which source rank's heads fill which heads of ``target_rank``'s slabs.

    ``source_heads`` / ``target_heads`` are kv heads per rank. The sizes must
    already be compatible (see :func:`check_compatible`); this only maps.
    """
    mode = plan_mode(source_tp, target_tp, is_mla=is_mla)
    if mode == "mla":
        return (HeadSlice((target_rank + mla_offset) % source_tp, 0, source_heads, 0),)
    if mode == "same_tp":
        return (HeadSlice(target_rank, 0, source_heads, 0),)
    if mode == "split_heads":
        k = target_tp // source_tp
        lo = (target_rank % k) * target_heads
        return (HeadSlice(target_rank // k, lo, lo + target_heads, 0),)
    k = source_tp // target_tp
    return tuple(HeadSlice(target_rank * k + j, 0, source_heads, j * source_heads) for j in range(k))


def source_ranks_for(target_rank: int, *, source_tp: int, target_tp: int, is_mla: bool,
                     mla_offset: int = 0) -> tuple[int, ...]:
    """The source ranks ``target_rank`` reads from (whose agent metadata it needs), ascending."""
    mode = plan_mode(source_tp, target_tp, is_mla=is_mla)
    if mode == "mla":
        return ((target_rank + mla_offset) % source_tp,)
    if mode == "same_tp":
        return (target_rank,)
    if mode == "split_heads":
        return (target_rank // (target_tp // source_tp),)
    k = source_tp // target_tp
    return tuple(range(target_rank * k, target_rank * k + k))


def slice_pieces(src: BlockLayout, sl: HeadSlice, target_heads: int) -> tuple[np.ndarray | None, int]:
    """Where slice ``sl``'s bytes lie inside one source block: ``(offsets, piece_bytes)``.

    ``offsets`` is None when the slice is the block's whole slab run (one
    piece of ``num_layers * kv * slab_bytes`` at offset 0: same TP, MLA);
    otherwise one ``uint64`` offset per slab (layer, then K/V), each piece
    ``(source_hi - source_lo)`` heads long. Block padding is never part of a
    piece. Staged, the pieces of one block lie back to back in this order.
    """
    u = np.uint64
    nheads = sl.source_hi - sl.source_lo
    slabs = src.num_layers * src.kv
    if sl.source_lo == 0 and nheads == src.num_kv_heads == target_heads:
        return None, slabs * src.slab_bytes
    per_head = src.tokens_per_block * src.head_dim * src.dtype_bytes
    return np.arange(slabs, dtype=u) * u(src.slab_bytes) + u(sl.source_lo * per_head), nheads * per_head
