"""Every message remote-g2 sends, as typed dataclasses, in one table.

Each request type is registered with :func:`message` under its wire name,
together with the dataclass its ``OK`` reply carries. :data:`MESSAGES` is the
one table the codec, the RPC server and the docs consult; ``docs/protocol.md``
lists the same messages for people (a test keeps the two in step).

Field annotations are the wire schema (see :mod:`remote_g2.protocol.schema`): what a
field may hold and how big it may be is declared here, next to the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeVar

from remote_g2.errors import UnknownMessage
from remote_g2.identity.model_identity import identity_of
from remote_g2.protocol.schema import BlockHash, HashList, Limits, Packed, decoder_for, encoder_for

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """One row of the message table: wire name, request class, reply class."""

    name: str
    request: type
    reply: type | None  # None: a one-way message (local links only)
    doc: str


MESSAGES: dict[str, MessageSpec] = {}
_by_class: dict[type, MessageSpec] = {}


def message(name: str, *, reply: type | None) -> Callable[[type[T]], type[T]]:
    """Register a request dataclass under ``name`` with the dataclass of its reply.

    ``reply=None`` registers a one-way message: it travels only over a
    worker's private :mod:`~remote_g2.rpc.local_link` links or the registry's
    change feed, never as an RPC (no RPC server has a handler for it, so one
    sent there is answered ``ERR``).

    Compiles both codecs at import time so a bad annotation fails loudly at
    start-up rather than on the first request. A duplicate name is an error.
    """

    def register(cls: type[T]) -> type[T]:
        if name in MESSAGES or name in ("OK", "ERR"):
            raise TypeError(f"duplicate message name {name!r}")
        cls.WIRE_NAME = name  # type: ignore[attr-defined]
        for c in (cls, reply) if reply is not None else (cls,):
            decoder_for(c)
            encoder_for(c)
        spec = MessageSpec(name, cls, reply, (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else "")
        MESSAGES[name] = spec
        _by_class[cls] = spec
        return cls

    return register


def spec_for_request(cls: type) -> MessageSpec:
    """The table row for a request class; :class:`UnknownMessage` if it is not registered."""
    spec = _by_class.get(cls)
    if spec is None:
        raise UnknownMessage(f"{cls.__name__} is not a registered request message")
    return spec


_Name = Annotated[str, Limits(max_len=128)]
_Text = Annotated[str, Limits(max_len=4096)]


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """Body of an ``ERR`` reply: the error class name and a human message."""

    name: _Name
    message: _Text


# --------------------------------------------------------------------------
# Core: answered by every remote-g2 server
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Pong:
    """Who answered a ``ping``: server kind, package version, uptime."""

    server: _Name
    version: _Name
    uptime_s: float


@message("ping", reply=Pong)
@dataclass(frozen=True, slots=True)
class Ping:
    """Liveness and identity check; every remote-g2 server answers it."""


# --------------------------------------------------------------------------
# Registry: served by `remote-g2 serve`
# --------------------------------------------------------------------------

_WorkerId = Annotated[str, Limits(min_len=1, max_len=128)]
_Endpoint = Annotated[str, Limits(min_len=1, max_len=256)]
_Count = Annotated[int, Limits(ge=0)]
_Epoch = Annotated[int, Limits(ge=0)]
_Seq = Annotated[int, Limits(ge=1)]
_Short = Annotated[str, Limits(max_len=64)]

LookupReason = Literal["ok", "no_candidate", "source_is_target", "incompatible_layout"]
WorkerStatus = Literal["ok", "resync_needed", "unknown_worker"]


@dataclass(frozen=True, slots=True)
class LayoutFingerprint:
    """What must match for a source's KV blocks to be usable by a target.

    ``num_kv_heads`` counts heads across the whole model (not per rank). Two
    workers are compatible when everything but ``tp_size`` matches: the target
    plans heterogeneous-TP reads for that difference.

    ``dtype`` is the dtype of the KV tensors themselves (plus the KV-cache
    quantisation where one is set), resolved by the adapter from the tensors,
    never a configuration string such as ``"auto"``. ``hash_scheme`` names
    the hash space the worker's block hashes live in (the engine's algorithm
    and seed): equal hashes mean the same prefix only between workers of one
    scheme. ``model_id`` reads ``LABEL#IDENTITY``: the identity is a digest of
    the weights the engine loaded and the options that change K and V
    (:mod:`remote_g2.identity.model_identity`), the label a name for people that
    matching ignores.
    """

    model_id: Annotated[str, Limits(min_len=1, max_len=256)]
    dtype: _Short
    tokens_per_block: Annotated[int, Limits(ge=1)]
    kv_layout: _Short
    num_layers: Annotated[int, Limits(ge=1)]
    num_kv_heads: Annotated[int, Limits(ge=1)]
    head_dim: Annotated[int, Limits(ge=1)]
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    is_mla: bool = False
    hash_scheme: _Short = ""

    @property
    def model_identity(self) -> str:
        """The part of ``model_id`` that matching compares: after its last ``#`` (the label before it is for
        people; :mod:`remote_g2.identity.model_identity`), all of it when there is none."""
        return identity_of(self.model_id)

    def compat_key(self) -> str:
        """A short stable digest of every field but ``tp_size`` (of ``model_id``, its :attr:`model_identity`)."""
        text = "|".join(str(x) for x in (self.model_identity, self.dtype, self.tokens_per_block, self.kv_layout,
                                          self.num_layers, self.num_kv_heads, self.head_dim, self.is_mla)
                        + ((self.hash_scheme,) if self.hash_scheme else ()))
        return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


@dataclass(frozen=True, slots=True)
class WorkerRecord:
    """A worker as the registry knows it; ``live`` means its lease has not lapsed."""

    worker_id: _WorkerId
    endpoint: _Endpoint
    epoch: _Epoch
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    fingerprint: LayoutFingerprint
    live: bool
    lease_expires_in_ms: int
    blocks: _Count
    last_seq: _Count
    load: _Count
    registered_at_ms: _Count


@dataclass(frozen=True, slots=True)
class RegisterWorkerReply:
    """The lease the worker must renew, and the sequence number its next event batch carries."""

    lease_ttl_ms: Annotated[int, Limits(ge=1)]
    next_seq: _Seq
    new_incarnation: bool


@message("register_worker", reply=RegisterWorkerReply)
@dataclass(frozen=True, slots=True)
class RegisterWorker:
    """Announce a worker; a higher epoch than the known one drops everything the old epoch held."""

    worker_id: _WorkerId
    endpoint: _Endpoint
    fingerprint: LayoutFingerprint
    epoch: _Epoch


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """``unknown_worker`` means: register again (new epoch) and resync."""

    status: WorkerStatus
    lease_ttl_ms: _Count


@message("heartbeat", reply=HeartbeatReply)
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Renew the worker's liveness lease; ``load`` (e.g. open leases) breaks lookup ties."""

    worker_id: _WorkerId
    epoch: _Epoch
    load: _Count = 0


@dataclass(frozen=True, slots=True)
class BlockEvent:
    """One change to a worker's G2 contents."""

    kind: Literal["stored", "removed", "cleared"]
    hashes: HashList = field(default_factory=list)
    parent: BlockHash | None = None


@dataclass(frozen=True, slots=True)
class EventsReply:
    """``resync_needed``: the batch was not applied; send a full ``resync`` then continue at ``expected_seq``."""

    status: WorkerStatus
    expected_seq: _Count
    applied: _Count


@message("events", reply=EventsReply)
@dataclass(frozen=True, slots=True)
class Events:
    """A batch of block events; ``seq`` must be the worker's next sequence number."""

    worker_id: _WorkerId
    epoch: _Epoch
    seq: _Seq
    events: Annotated[list[BlockEvent], Limits(max_len=4096)]


@dataclass(frozen=True, slots=True)
class ResyncReply:
    """Outcome of one resync chunk; ``stored`` counts the worker's hashes after it."""

    status: WorkerStatus
    expected_seq: _Count
    stored: _Count


@message("resync", reply=ResyncReply)
@dataclass(frozen=True, slots=True)
class Resync:
    """Replace the worker's hashes with a snapshot, sent in chunks.

    The chunk with ``first`` clears what the registry had; after the chunk with
    ``last`` the registry expects event batch ``seq`` next.
    """

    worker_id: _WorkerId
    epoch: _Epoch
    seq: _Seq
    hashes: HashList
    first: bool
    last: bool


@dataclass(frozen=True, slots=True)
class Holder:
    """A live, compatible worker holding a prefix of the asked hashes."""

    worker_id: _WorkerId
    endpoint: _Endpoint
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    matched: _Count


@dataclass(frozen=True, slots=True)
class LookupReply:
    """The best owner (longest matched prefix) or, when none, why not."""

    reason: LookupReason
    matched: _Count
    best: Holder | None = None
    holders: Annotated[list[Holder], Limits(max_len=4096)] = field(default_factory=list)


@message("lookup", reply=LookupReply)
@dataclass(frozen=True, slots=True)
class Lookup:
    """Who holds the longest prefix of ``hashes``?

    ``requester`` is excluded from the answer (and, when registered, supplies
    the layout to match unless ``compat_key`` is given).
    """

    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=65_536)]
    requester: _WorkerId | None = None
    compat_key: _Short | None = None
    want_all_holders: bool = False


@dataclass(frozen=True, slots=True)
class WhoHasReply:
    """``holders[i]`` lists the live worker ids holding ``hashes[i]``."""

    holders: Annotated[list[Annotated[list[_WorkerId], Limits(max_len=4096)]], Limits(max_len=4096)]


@message("who_has", reply=WhoHasReply)
@dataclass(frozen=True, slots=True)
class WhoHas:
    """Admin: the holders of each hash, independently (no prefix walk)."""

    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=4096)]
    include_dead: bool = False


@dataclass(frozen=True, slots=True)
class WorkerInfoReply:
    """The worker's record, or None when the registry does not know it."""

    worker: WorkerRecord | None = None


@message("worker_info", reply=WorkerInfoReply)
@dataclass(frozen=True, slots=True)
class WorkerInfo:
    """Admin: one worker's record."""

    worker_id: _WorkerId


@dataclass(frozen=True, slots=True)
class ListWorkersReply:
    """Every worker the registry knows."""

    workers: Annotated[list[WorkerRecord], Limits(max_len=65_536)]


@message("list_workers", reply=ListWorkersReply)
@dataclass(frozen=True, slots=True)
class ListWorkers:
    """Admin: all workers; dead ones (lease lapsed, not yet swept) only when asked."""

    include_dead: bool = False


@dataclass(frozen=True, slots=True)
class StatsReply:
    """Registry-wide counters (this server's counters plus the store's sizes)."""

    store: _Short
    workers_live: _Count
    workers_total: _Count
    block_entries: _Count
    lookups: _Count
    lookup_hits: _Count
    events_ingested: _Count
    uptime_s: float
    mirror: Literal["off", "syncing", "ready"] = "off"


@message("stats", reply=StatsReply)
@dataclass(frozen=True, slots=True)
class Stats:
    """Admin: sizes and counters."""


@dataclass(frozen=True, slots=True)
class DrainWorkerReply:
    """Whether the worker existed, and how many block entries were dropped."""

    existed: bool
    removed_blocks: _Count


@message("drain_worker", reply=DrainWorkerReply)
@dataclass(frozen=True, slots=True)
class DrainWorker:
    """Admin: forget a worker and everything it holds (it must re-register to come back)."""

    worker_id: _WorkerId


@dataclass(frozen=True, slots=True)
class FeedInfoReply:
    """Where this server publishes its change feed (``endpoint`` empty: no feed), its identity and position.

    ``instance`` changes every time the server starts, so a follower can tell
    a restart (its numbering starts again at 1) from a gap.
    """

    endpoint: Annotated[str, Limits(max_len=256)]
    instance: _Short
    seq: _Count
    lease_ttl_ms: Annotated[int, Limits(ge=1)]


@message("feed_info", reply=FeedInfoReply)
@dataclass(frozen=True, slots=True)
class FeedInfo:
    """Mirror: this server's change-feed endpoint, instance id and last published sequence number."""


@dataclass(frozen=True, slots=True)
class ScanWorkerReply:
    """One chunk of a worker's hashes; ``cursor`` empty: that was the last chunk.

    ``worker`` is the record as of this chunk (None: unknown or dead). A hash
    held for the whole scan is returned at least once; one added or removed
    during the scan may or may not be, so a follower replays the feed from
    before the first chunk.
    """

    worker: WorkerRecord | None
    hashes: HashList
    cursor: Annotated[bytes, Limits(max_len=64)]


@message("scan_worker", reply=ScanWorkerReply)
@dataclass(frozen=True, slots=True)
class ScanWorker:
    """Mirror: the next chunk of a live worker's hashes, from ``cursor`` (empty: the start)."""

    worker_id: _WorkerId
    cursor: Annotated[bytes, Limits(max_len=64)] = b""
    count: Annotated[int, Limits(ge=1, le=65_536)] = 16_384


@message("feed_tick", reply=None)
@dataclass(frozen=True, slots=True)
class FeedTick:
    """The change feed's pulse: sent every ``tick`` on an idle feed; ``seq`` is the last entry published.

    Every other feed frame is a registry write that succeeded (``register_worker``,
    ``heartbeat``, ``events``, ``resync``, ``drain_worker``) whose header ``id``
    is its feed sequence number. One-way: it travels only on the feed.
    """

    seq: _Count


# --------------------------------------------------------------------------
# Source: rank 0 of a sharing worker serves these over TCP
# --------------------------------------------------------------------------

_AgentName = Annotated[str, Limits(min_len=1, max_len=256)]
_Blob = Annotated[bytes, Limits(max_len=4 * 1024 * 1024)]  # NIXL agent metadata
_Rank = Annotated[int, Limits(ge=0, le=4095)]
_Addr = Annotated[int, Limits(ge=0)]
_Ttl = Annotated[int, Limits(ge=1, le=3_600_000)]
_Ids = Annotated[list[Annotated[int, Limits(ge=0)]], Limits(max_len=65_536), Packed()]  # u64 LE bin on the wire
ResolveReason = Literal["ok", "miss", "over_budget"]


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

    rank: _Rank
    agent_name: _AgentName
    agent_metadata: _Blob | None
    pool_base: _Addr
    pool_bytes: _Addr
    layout: BlockLayout
    #: Where this rank answers ``peer_resolve`` itself (ranks > 0; None: it does not, ask rank 0).
    peer_endpoint: _Endpoint | None = None
    #: This rank's staging region, registered with its agent (0 bytes: it never gathers); a
    #: :class:`GatherSlot` always lies inside it.
    staging_base: _Addr = 0
    staging_bytes: _Addr = 0


@dataclass(frozen=True, slots=True)
class SourceMetadataReply:
    """Everything a target needs to read from this worker, per rank; ``epoch`` changes on restart."""

    worker_id: _WorkerId
    epoch: _Epoch
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    ranks: Annotated[list[RankInfo], Limits(max_len=4096)]


@message("get_metadata", reply=SourceMetadataReply)
@dataclass(frozen=True, slots=True)
class GetMetadata:
    """The source's per-rank agent metadata, pool regions and layouts."""


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
    mla_offset: _Count = 0
    target_rank: _Rank | None = None


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

    target_rank: _Rank
    addr: _Addr
    block_stride: Annotated[int, Limits(ge=1)]
    blocks: _Count
    ready_addr: _Addr
    chunk_blocks: Annotated[int, Limits(ge=1)]


_Staged = Annotated[list[GatherSlot], Limits(max_len=4096)]


@dataclass(frozen=True, slots=True)
class RankBlocks:
    """The pinned blocks of one rank for a lease, in the order of the asked hashes, and what it staged."""

    rank: _Rank
    block_ids: _Ids
    staged: _Staged = field(default_factory=list)


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
    lease_id: _Count
    matched: _Count
    epoch: _Epoch
    expires_in_ms: _Count
    ranks: Annotated[list[RankBlocks], Limits(max_len=4096)] = field(default_factory=list)
    metadata: Annotated[list[RankInfo], Limits(max_len=4096)] = field(default_factory=list)


@message("resolve", reply=ResolveReply)
@dataclass(frozen=True, slots=True)
class Resolve:
    """Pin the longest prefix of ``hashes`` present on every rank, for ``ttl_ms``."""

    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=65_536)]
    ttl_ms: _Ttl
    requester: _WorkerId | None = None
    known_agents: Annotated[list[_AgentName], Limits(max_len=4096)] = field(default_factory=list)
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
    reason: _Short = ""
    agent_name: _AgentName | None = None
    epoch: _Epoch = 0
    base: _Addr = 0
    buckets: Annotated[int, Limits(ge=0, le=1 << 32)] = 0
    ways: Annotated[int, Limits(ge=0, le=64)] = 0
    slot_bytes: Annotated[int, Limits(ge=0, le=4096)] = 0


@message("chunk_table", reply=ChunkTableReply)
@dataclass(frozen=True, slots=True)
class ChunkTable:
    """Ask a vLLM tier holder where its chunk table is (:class:`ChunkTableReply`)."""

    requester: _WorkerId | None = None


@dataclass(frozen=True, slots=True)
class PeerResolveReply:
    """This rank's share of a lease: ``block_ids[i]`` holds ``hashes[i]``, for the first ``matched`` hashes.

    ``epoch`` is the worker's (the same on every rank); ``matched`` is 0 and
    ``block_ids`` empty when nothing was pinned (``reason`` says why).
    """

    reason: ResolveReason
    matched: _Count
    epoch: _Epoch
    expires_in_ms: _Count
    block_ids: _Ids = field(default_factory=list)
    staged: _Staged = field(default_factory=list)


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
    ttl_ms: _Ttl
    requester: _WorkerId | None = None
    gather: GatherWish | None = None


@dataclass(frozen=True, slots=True)
class RenewReply:
    """``renewed`` is False when the lease is gone; then its blocks are no longer safe to read."""

    renewed: bool
    expires_in_ms: _Count


@message("renew", reply=RenewReply)
@dataclass(frozen=True, slots=True)
class Renew:
    """Extend a lease (for a transfer that outlives half its TTL)."""

    lease_id: Annotated[int, Limits(ge=1)]
    ttl_ms: _Ttl


# --------------------------------------------------------------------------
# Source siblings: rank 0 → rank r > 0 over the worker's private IPC sockets
# --------------------------------------------------------------------------


#: The identity of the connection a lease belongs to, as rank 0's server drew it
#: (remote_g2/rpc/connection_identity.py); rank 0 hands it to its siblings so that every share is bound to it.
_Owner = Annotated[bytes, Limits(min_len=1, max_len=256)]


@dataclass(frozen=True, slots=True)
class SiblingPinReply:
    """Block ids this rank pinned under the lease, for the longest prefix it holds, and what it staged."""

    block_ids: _Ids
    staged: _Staged = field(default_factory=list)


@message("sibling_pin", reply=SiblingPinReply)
@dataclass(frozen=True, slots=True)
class SiblingPin:
    """Find-and-pin ``hashes`` on this rank under ``lease_id`` until ``ttl_ms`` passes, for ``owner``."""

    lease_id: Annotated[int, Limits(ge=1)]
    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=65_536)]
    ttl_ms: _Ttl
    owner: _Owner
    gather: GatherWish | None = None


#: The largest ``resolve`` frame rank 0 hands its siblings as it arrives (``sibling_resolve``); a valid
#: one of 65 536 hashes of 32 bytes is ~2.2 MiB. Larger frames take the ``sibling_pin`` path (and are
#: refused there by the decoder), so a peer cannot make rank 0 copy 16 MiB frames to every sibling.
MAX_FORWARDED_RESOLVE_BYTES = 4 * 1024 * 1024


@message("sibling_resolve", reply=SiblingPinReply)
@dataclass(frozen=True, slots=True)
class SiblingResolve:
    """Find-and-pin, under ``lease_id``, the hashes of ``resolve``: a target's ``resolve`` frame, as received.

    Rank 0 forwards the frame before it has decoded it itself, so the
    sibling's pinning overlaps rank 0's own decoding and bookkeeping. The
    sibling decodes and checks the frame exactly as rank 0's server does
    (a frame rank 0 would refuse is refused here too, and nothing is
    pinned) and clamps its ``ttl_ms`` to the same bounds. The share belongs
    to ``owner``, the connection that sent the resolve.
    """

    lease_id: Annotated[int, Limits(ge=1)]
    resolve: Annotated[bytes, Limits(min_len=1, max_len=MAX_FORWARDED_RESOLVE_BYTES)]
    owner: _Owner


@dataclass(frozen=True, slots=True)
class SiblingAck:
    """``known`` is False when this rank held no pins under that lease."""

    known: bool


@message("sibling_trim", reply=SiblingAck)
@dataclass(frozen=True, slots=True)
class SiblingTrim:
    """Keep only the first ``keep`` pinned blocks of the lease (the prefix every rank has)."""

    lease_id: Annotated[int, Limits(ge=1)]
    keep: _Count


@message("sibling_release", reply=SiblingAck)
@dataclass(frozen=True, slots=True)
class SiblingRelease:
    """Unpin everything this rank holds under the lease for ``owner``; idempotent.

    A share that belongs to another connection (a peer share, say) is left
    alone and answered as unknown.
    """

    lease_id: Annotated[int, Limits(ge=1)]
    owner: _Owner


@message("sibling_renew", reply=SiblingAck)
@dataclass(frozen=True, slots=True)
class SiblingRenew:
    """Extend this rank's copy of the lease, if it belongs to ``owner``."""

    lease_id: Annotated[int, Limits(ge=1)]
    ttl_ms: _Ttl
    owner: _Owner


# --------------------------------------------------------------------------
# Target ranks: the leader (rank 0) → rank r > 0, and back, one-way over the worker's local links
# --------------------------------------------------------------------------


@message("link_hello", reply=None)
@dataclass(frozen=True, slots=True)
class LinkHello:
    """The first message on a local link: the connecting process is TP rank ``rank`` of ``worker_id``."""

    worker_id: _WorkerId
    rank: _Rank


@message("target_load", reply=None)
@dataclass(frozen=True, slots=True)
class TargetLoad:
    """Read this rank's share of a resolved lease into ``dst_block_ids`` within ``timeout_ms``.

    ``load_id`` is the leader's id for the request. ``metadata`` lists every
    source rank; ``agent_metadata`` rides along only the first time the leader
    sends a (source worker, epoch), and ranks keep it. ``deadline_ns`` is the
    leader's ``time.monotonic_ns()`` after which no READ may start; a rank that
    shares the leader's clock (same host boot) uses it as is, any other rank
    counts ``timeout_ms`` from when the message reached it.
    """

    load_id: Annotated[int, Limits(ge=1)]
    source_worker: _WorkerId
    source_epoch: _Epoch
    source_tp: Annotated[int, Limits(ge=1, le=4096)]
    is_mla: bool
    mla_offset: _Count
    ranks: Annotated[list[RankBlocks], Limits(max_len=4096)]
    metadata: Annotated[list[RankInfo], Limits(max_len=4096)]
    dst_block_ids: _Ids
    timeout_ms: _Ttl
    deadline_ns: _Count = 0
    #: Set when this rank resolves its own share (``ranks`` is then empty): the ``peer_resolve`` it sends
    #: its peer source rank, as the leader sends its own. It loads the prefix its peer pinned.
    peer: PeerResolve | None = None
    #: The engine's request id, so that every rank can tell its engine how its own share ended.
    request_id: _Text = ""


@message("target_done", reply=None)
@dataclass(frozen=True, slots=True)
class TargetDone:
    """A rank finished its share of load ``load_id``: every byte landed (``ok``) or not (``error``)."""

    load_id: Annotated[int, Limits(ge=1)]
    rank: _Rank
    ok: bool
    error: _Text = ""
    nbytes: _Count = 0
    descriptors: _Count = 0
    blocks: _Count = 0  # leading destination blocks loaded (a peer-resolved share may be shorter than asked)
    peer_failed: bool = False  # the share's peer_resolve went unanswered or answered ERR (not a miss)
