"""The registry conversation: a worker (and the admin CLI) ↔ the registry server (`remote-g2 serve`).

A worker registers with its :class:`LayoutFingerprint`, renews its lease
(``heartbeat``), reports what its G2 holds (``events``, ``resync``); a target
asks who holds a prefix (``lookup``); the admin reads and drains
(``who_has``, ``worker_info``, ``list_workers``, ``stats``, ``drain_worker``).
A mirror follows a server through ``feed_info`` and ``scan_worker`` and its
change feed, whose idle pulse is the one-way ``feed_tick``.

Registered in the one table (:mod:`remote_g2.protocol.messages`); ``docs/protocol.md``
"Registry messages" and "The registry's change feed" list them for people.
Field annotations are the wire schema (:mod:`remote_g2.protocol.schema`).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Annotated, Literal

from remote_g2.identity.model_identity import identity_of
from remote_g2.protocol.schema import BlockHash, HashList, Limits
from remote_g2.protocol.spec import Count, Endpoint, Epoch, Short, WorkerId, message

_Seq = Annotated[int, Limits(ge=1)]

LookupReason = Literal["ok", "no_candidate", "source_is_target", "incompatible_layout"]
WorkerStatus = Literal["ok", "resync_needed", "unknown_worker"]
#: What a worker record stands for when it is not a source's (a worker whose source serves its G2 pool, the
#: record's kind None): a stock engine the registry follows from its KV events alone (``serve
#: --vllm-kv-events``), scored for routers, never read from. None is left out on the wire, so a registry or a
#: client that predates kinds still decodes every source's messages (a rolling upgrade).
WorkerKind = Literal["events-only"]


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
    dtype: Short
    tokens_per_block: Annotated[int, Limits(ge=1)]
    kv_layout: Short
    num_layers: Annotated[int, Limits(ge=1)]
    num_kv_heads: Annotated[int, Limits(ge=1)]
    head_dim: Annotated[int, Limits(ge=1)]
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    is_mla: bool = False
    hash_scheme: Short = ""

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

    worker_id: WorkerId
    endpoint: Endpoint
    epoch: Epoch
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    fingerprint: LayoutFingerprint
    live: bool
    lease_expires_in_ms: int
    blocks: Count
    last_seq: Count
    load: Count
    registered_at_ms: Count
    kind: WorkerKind | None = None


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

    worker_id: WorkerId
    endpoint: Endpoint
    fingerprint: LayoutFingerprint
    epoch: Epoch
    kind: WorkerKind | None = None


@dataclass(frozen=True, slots=True)
class HeartbeatReply:
    """``unknown_worker`` means: register again (new epoch) and resync."""

    status: WorkerStatus
    lease_ttl_ms: Count


@message("heartbeat", reply=HeartbeatReply)
@dataclass(frozen=True, slots=True)
class Heartbeat:
    """Renew the worker's liveness lease; ``load`` (e.g. open leases) breaks lookup ties."""

    worker_id: WorkerId
    epoch: Epoch
    load: Count = 0


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
    expected_seq: Count
    applied: Count


@message("events", reply=EventsReply)
@dataclass(frozen=True, slots=True)
class Events:
    """A batch of block events; ``seq`` must be the worker's next sequence number."""

    worker_id: WorkerId
    epoch: Epoch
    seq: _Seq
    events: Annotated[list[BlockEvent], Limits(max_len=4096)]


@dataclass(frozen=True, slots=True)
class ResyncReply:
    """Outcome of one resync chunk; ``stored`` counts the worker's hashes after it."""

    status: WorkerStatus
    expected_seq: Count
    stored: Count


@message("resync", reply=ResyncReply)
@dataclass(frozen=True, slots=True)
class Resync:
    """Replace the worker's hashes with a snapshot, sent in chunks.

    The chunk with ``first`` clears what the registry had; after the chunk with
    ``last`` the registry expects event batch ``seq`` next.
    """

    worker_id: WorkerId
    epoch: Epoch
    seq: _Seq
    hashes: HashList
    first: bool
    last: bool


@dataclass(frozen=True, slots=True)
class Holder:
    """A live, compatible worker holding a prefix of the asked hashes."""

    worker_id: WorkerId
    endpoint: Endpoint
    tp_size: Annotated[int, Limits(ge=1, le=4096)]
    matched: Count


@dataclass(frozen=True, slots=True)
class LookupReply:
    """The best owner (longest matched prefix) or, when none, why not."""

    reason: LookupReason
    matched: Count
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
    requester: WorkerId | None = None
    compat_key: Short | None = None
    want_all_holders: bool = False


@dataclass(frozen=True, slots=True)
class WhoHasReply:
    """``holders[i]`` lists the live worker ids holding ``hashes[i]``."""

    holders: Annotated[list[Annotated[list[WorkerId], Limits(max_len=4096)]], Limits(max_len=4096)]


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

    worker_id: WorkerId


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

    store: Short
    workers_live: Count
    workers_total: Count
    block_entries: Count
    lookups: Count
    lookup_hits: Count
    events_ingested: Count
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
    removed_blocks: Count


@message("drain_worker", reply=DrainWorkerReply)
@dataclass(frozen=True, slots=True)
class DrainWorker:
    """Admin: forget a worker and everything it holds (it must re-register to come back)."""

    worker_id: WorkerId


@dataclass(frozen=True, slots=True)
class FeedInfoReply:
    """Where this server publishes its change feed (``endpoint`` empty: no feed), its identity and position.

    ``instance`` changes every time the server starts, so a follower can tell
    a restart (its numbering starts again at 1) from a gap.
    """

    endpoint: Annotated[str, Limits(max_len=256)]
    instance: Short
    seq: Count
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

    worker_id: WorkerId
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

    seq: Count
