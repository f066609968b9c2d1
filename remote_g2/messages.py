"""Every message remote-g2 sends, as typed dataclasses, in one table.

Each request type is registered with :func:`message` under its wire name,
together with the dataclass its ``OK`` reply carries. :data:`MESSAGES` is the
one table the codec, the RPC server and the docs consult; ``docs/protocol.md``
lists the same messages for people (a test keeps the two in step).

Field annotations are the wire schema (see :mod:`remote_g2.schema`): what a
field may hold and how big it may be is declared here, next to the field.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal, TypeVar

from remote_g2.errors import UnknownMessage
from remote_g2.schema import BlockHash, HashList, Limits, decoder_for, encoder_for

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class MessageSpec:
    """One row of the message table: wire name, request class, reply class."""

    name: str
    request: type
    reply: type
    doc: str


MESSAGES: dict[str, MessageSpec] = {}
_by_class: dict[type, MessageSpec] = {}


def message(name: str, *, reply: type) -> Callable[[type[T]], type[T]]:
    """Register a request dataclass under ``name`` with the dataclass of its reply.

    Compiles both codecs at import time so a bad annotation fails loudly at
    start-up rather than on the first request. A duplicate name is an error.
    """

    def register(cls: type[T]) -> type[T]:
        if name in MESSAGES or name in ("OK", "ERR"):
            raise TypeError(f"duplicate message name {name!r}")
        cls.WIRE_NAME = name  # type: ignore[attr-defined]
        for c in (cls, reply):
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

    def compat_key(self) -> str:
        """A short stable digest of every field but ``tp_size``."""
        text = "|".join(str(x) for x in (self.model_id, self.dtype, self.tokens_per_block, self.kv_layout,
                                          self.num_layers, self.num_kv_heads, self.head_dim, self.is_mla))
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
