"""A source rank as the wire describes it, shared by the source, sibling and target-rank conversations.

:class:`BlockLayout` says where each block (and each head's bytes in it) sits
in a rank's pool region; :class:`RankInfo` is one rank's NIXL agent, pool and
staging regions and layout (``get_metadata``, ``resolve``, ``target_load``).
:class:`RankBlocks` is what a lease pinned on one rank; :class:`GatherWish`
asks the ranks to stage a lease's bytes packed per target rank, and
:class:`GatherSlot` is where one such share was staged.

None of these is a message of its own: they are fields of the messages in
:mod:`.source_messages`, :mod:`.sibling_messages` and :mod:`.target_rank_messages`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from remote_g2.protocol.schema import Limits
from remote_g2.protocol.spec import Addr, AgentName, BlockIds, Count, Endpoint, Rank

_Blob = Annotated[bytes, Limits(max_len=4 * 1024 * 1024)]  # NIXL agent metadata


@dataclass(frozen=True, slots=True)
class BlockLayout:
    """How blocks sit in one rank's pool region.

    A block is ``block_bytes`` long and starts at ``pool_base + block_id * block_bytes``.
    Inside it, ``num_layers * kv`` slabs follow each other; a slab is
    ``num_kv_heads * tokens_per_block * head_dim * dtype_bytes`` and is ordered
    heads-outermost for ``order == "HND"`` (so a head range is contiguous) or
    tokens-outermost for ``"NHD"``.
    """

    num_blocks: Annotated[int, Limits(ge=1)]
    block_bytes: Annotated[int, Limits(ge=1)]
    num_layers: Annotated[int, Limits(ge=1)]
    kv: Annotated[int, Limits(ge=1, le=2)]
    num_kv_heads: Annotated[int, Limits(ge=1)]
    tokens_per_block: Annotated[int, Limits(ge=1)]
    head_dim: Annotated[int, Limits(ge=1)]
    dtype_bytes: Annotated[int, Limits(ge=1, le=16)]
    order: Literal["HND", "NHD"]

    @property
    def slab_bytes(self) -> int:
        """Bytes of one (layer, k-or-v) slab: every head, token and dim of it."""
        return self.num_kv_heads * self.tokens_per_block * self.head_dim * self.dtype_bytes

    def head_extents(self, block_id: int, head_lo: int, head_hi: int) -> list[tuple[int, int]]:
        """``(offset, nbytes)`` in the region of heads ``[head_lo, head_hi)`` of a block, one per slab.

        Only an ``HND`` layout keeps a head range contiguous inside a slab; for
        all heads the block is returned as one extent.
        """
        if not 0 <= head_lo < head_hi <= self.num_kv_heads:
            raise ValueError(f"head range [{head_lo}, {head_hi}) outside 0..{self.num_kv_heads}")
        base = block_id * self.block_bytes
        if head_lo == 0 and head_hi == self.num_kv_heads:
            return [(base, self.num_layers * self.kv * self.slab_bytes)]
        if self.order != "HND":
            raise ValueError("a head slice needs the head-major (HND) layout")
        per_head = self.tokens_per_block * self.head_dim * self.dtype_bytes
        return [(base + s * self.slab_bytes + head_lo * per_head, (head_hi - head_lo) * per_head)
                for s in range(self.num_layers * self.kv)]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """One source rank: its NIXL agent and its pool region."""

    rank: Rank
    agent_name: AgentName
    agent_metadata: _Blob | None
    pool_base: Addr
    pool_bytes: Addr
    layout: BlockLayout
    #: Where this rank answers ``peer_resolve`` itself (ranks > 0; None: it does not, ask rank 0).
    peer_endpoint: Endpoint | None = None
    #: This rank's staging region, registered with its agent (0 bytes: it never gathers); a
    #: :class:`GatherSlot` always lies inside it.
    staging_base: Addr = 0
    staging_bytes: Addr = 0


@dataclass(frozen=True, slots=True)
class GatherWish:
    """Ask every source rank to stage a lease's bytes packed, per target rank (remote_g2/source/gather.py).

    Describes the reader: ``target_tp`` ranks of ``target_heads`` kv heads
    each, ``is_mla`` / ``mla_offset`` as its READ plan takes them. A source
    rank stages a target rank's share only where that cuts the READ's
    descriptors and its staging budget has room; the others are read in place.
    ``target_rank`` set (a ``peer_resolve``: one target rank's own share):
    stage only what that target rank reads.
    """

    target_tp: Annotated[int, Limits(ge=1, le=4096)]
    target_heads: Annotated[int, Limits(ge=1, le=65_536)]
    is_mla: bool = False
    mla_offset: Count = 0
    target_rank: Rank | None = None


@dataclass(frozen=True, slots=True)
class GatherSlot:
    """One target rank's share of a lease, staged by one source rank in its staging region.

    The pieces of the lease's block ``i`` (in the order of
    :func:`remote_g2.tp.head_slices.slice_pieces`) lie back to back at
    ``addr + i * block_stride``, for the lease's first ``blocks`` blocks.
    They are staged in chunks of ``chunk_blocks`` blocks, after the reply:
    the little-endian u64 at ``ready_addr`` (in the staging region) counts
    the leading blocks staged so far — a reader READs it, then the blocks it
    covers. The slot lives as long as the lease.
    """

    target_rank: Rank
    addr: Addr
    block_stride: Annotated[int, Limits(ge=1)]
    blocks: Count
    ready_addr: Addr
    chunk_blocks: Annotated[int, Limits(ge=1)]


#: What one source rank staged for a lease: a slot per target rank it packed a share for.
Staged = Annotated[list[GatherSlot], Limits(max_len=4096)]


@dataclass(frozen=True, slots=True)
class RankBlocks:
    """The pinned blocks of one rank for a lease, in the order of the asked hashes, and what it staged."""

    rank: Rank
    block_ids: BlockIds
    staged: Staged = field(default_factory=list)
