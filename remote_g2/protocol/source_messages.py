"""The source conversation: a target ↔ the source worker it reads from, over TCP (or the stream lane).

Rank 0 of a sharing worker answers ``get_metadata`` (every rank's agent,
pool and layout), ``resolve`` (pin the longest prefix present on every rank,
as a lease), ``release`` and ``renew`` of a lease; with peer resolves each
target rank asks its peer source rank for its own share (``peer_resolve``,
rank 0 at the worker's endpoint, rank r at ``RankInfo.peer_endpoint``). A vLLM
tier holder answers ``chunk_table`` for one-sided lookups.

Registered in the one table (:mod:`remote_g2.protocol.messages`); ``docs/protocol.md``
"Source messages" and "vLLM tier holders" list them for people. The rank types
the replies carry are in :mod:`.rank_types`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Literal

from remote_g2.protocol.rank_types import GatherWish, RankBlocks, RankInfo, Staged
from remote_g2.protocol.schema import BlockHash, Limits
from remote_g2.protocol.spec import Addr, AgentName, BlockIds, Count, Epoch, Short, Ttl, WorkerId, message

ResolveReason = Literal["ok", "miss", "over_budget"]


@dataclass(frozen=True, slots=True)
class SourceMetadataReply:
    """Everything a target needs to read from this worker, per rank; ``epoch`` changes on restart."""

    worker_id: WorkerId
    epoch: Epoch
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    ranks: Annotated[list[RankInfo], Limits(max_len=4096)]


@message("get_metadata", reply=SourceMetadataReply)
@dataclass(frozen=True, slots=True)
class GetMetadata:
    """The source's per-rank agent metadata, pool regions and layouts."""


@dataclass(frozen=True, slots=True)
class ResolveReply:
    """A lease over the first ``matched`` hashes, pinned on every rank.

    ``ranks[r].block_ids[i]`` is the block holding ``hashes[i]`` on rank ``r``
    (its address: that rank's ``pool_base + block_id * block_bytes``).
    ``metadata`` carries :class:`RankInfo` for the ranks whose agent the caller
    did not list as known (``agent_metadata`` omitted otherwise). ``lease_id``
    is 0 when nothing was pinned (``reason`` says why).
    """

    reason: ResolveReason
    lease_id: Count
    matched: Count
    epoch: Epoch
    expires_in_ms: Count
    ranks: Annotated[list[RankBlocks], Limits(max_len=4096)] = field(default_factory=list)
    metadata: Annotated[list[RankInfo], Limits(max_len=4096)] = field(default_factory=list)


@message("resolve", reply=ResolveReply)
@dataclass(frozen=True, slots=True)
class Resolve:
    """Pin the longest prefix of ``hashes`` present on every rank, for ``ttl_ms``."""

    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=65_536)]
    ttl_ms: Ttl
    requester: WorkerId | None = None
    known_agents: Annotated[list[AgentName], Limits(max_len=4096)] = field(default_factory=list)
    #: Stage the lease's bytes for these readers where that cuts descriptors (see :class:`GatherWish`).
    gather: GatherWish | None = None


@dataclass(frozen=True, slots=True)
class ReleaseReply:
    """``released`` is False when the lease was unknown (already released or expired), or, for a lease that
    did not pin its blocks (the vLLM tier's validated leases), when one of them may have changed while it was
    open: a reader then discards what it read under the lease."""

    released: bool


@message("release", reply=ReleaseReply)
@dataclass(frozen=True, slots=True)
class Release:
    """Unpin a lease on every rank that holds a share of it for this connection; idempotent.

    From any other connection the answer is ``released: false``, as for an unknown lease.
    """

    lease_id: Annotated[int, Limits(ge=1)]


@dataclass(frozen=True, slots=True)
class ChunkTableReply:
    """Where the vLLM tier holder's chunk table is (adapters/vllm_tier/chunk_table.py), for one-sided lookups.

    ``granted`` is False (``reason`` says why, the other fields 0) where this connection's READs may need the
    holder's progress (emulated, or not yet past UCX's wire-up: a lease released here first). The table is
    ``buckets`` buckets of ``ways`` slots of ``slot_bytes`` from ``base``, registered by NIXL agent
    ``agent_name``; ``epoch`` is the holder's (the resolve replies')."""

    granted: bool
    reason: Short = ""
    agent_name: AgentName | None = None
    epoch: Epoch = 0
    base: Addr = 0
    buckets: Annotated[int, Limits(ge=0, le=1 << 32)] = 0
    ways: Annotated[int, Limits(ge=0, le=64)] = 0
    slot_bytes: Annotated[int, Limits(ge=0, le=4096)] = 0


@message("chunk_table", reply=ChunkTableReply)
@dataclass(frozen=True, slots=True)
class ChunkTable:
    """Ask a vLLM tier holder where its chunk table is (:class:`ChunkTableReply`)."""

    requester: WorkerId | None = None


@dataclass(frozen=True, slots=True)
class PeerResolveReply:
    """This rank's share of a lease: ``block_ids[i]`` holds ``hashes[i]``, for the first ``matched`` hashes.

    ``epoch`` is the worker's (the same on every rank); ``matched`` is 0 and
    ``block_ids`` empty when nothing was pinned (``reason`` says why).
    """

    reason: ResolveReason
    matched: Count
    epoch: Epoch
    expires_in_ms: Count
    block_ids: BlockIds = field(default_factory=list)
    staged: Staged = field(default_factory=list)


@message("peer_resolve", reply=PeerResolveReply)
@dataclass(frozen=True, slots=True)
class PeerResolve:
    """Pin, on the rank asked only, the longest prefix of ``hashes`` it holds, under the caller's ``lease_id``.

    Each target rank asks its peer source rank for its own share (rank 0 at
    the worker's endpoint, rank r at ``RankInfo.peer_endpoint``), all under
    one lease id the target chose, so the shares resolve in parallel with no
    hop through rank 0. Each share belongs to the connection that pinned it:
    only ``release`` / ``renew`` on that connection end or extend it (or
    expiry); rank 0's fan-out to its siblings does not reach another
    connection's shares.
    """

    lease_id: Annotated[int, Limits(ge=1)]
    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=65_536)]
    ttl_ms: Ttl
    requester: WorkerId | None = None
    gather: GatherWish | None = None


@dataclass(frozen=True, slots=True)
class RenewReply:
    """``renewed`` is False when the lease is gone; then its blocks are no longer safe to read."""

    renewed: bool
    expires_in_ms: Count


@message("renew", reply=RenewReply)
@dataclass(frozen=True, slots=True)
class Renew:
    """Extend a lease (for a transfer that outlives half its TTL)."""

    lease_id: Annotated[int, Limits(ge=1)]
    ttl_ms: Ttl
