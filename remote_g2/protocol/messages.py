"""Every message remote-g2 sends, in one table: :data:`MESSAGES`, filled from one module per conversation.

Each request type is registered with :func:`message` under its wire name,
together with the dataclass its ``OK`` reply carries (``None``: one-way).
:data:`MESSAGES` is the one table the codec, the RPC server and the docs
consult; ``docs/protocol.md`` lists the same messages for people (a test keeps
the two in step). Importing this module fills the table with every
conversation of the core, one module each:

* :mod:`~remote_g2.protocol.core_messages`: ``ping`` and the ``ERR`` body, for every server;
* :mod:`~remote_g2.protocol.registry_messages`: a worker and the admin ↔ the registry server, and the mirror's feed;
* :mod:`~remote_g2.protocol.source_messages`: a target ↔ the source worker (rank 0, or a peer rank);
* :mod:`~remote_g2.protocol.sibling_messages`: a source's rank 0 → its sibling ranks (IPC);
* :mod:`~remote_g2.protocol.target_rank_messages`: a target's leader ↔ its ranks (local links, one-way).

The machinery (:class:`MessageSpec`, :func:`message`, :func:`spec_for_request`)
and the shared field types live in :mod:`~remote_g2.protocol.spec`, the rank
types the source, sibling and target-rank messages share (``BlockLayout``,
``RankInfo``, …) in :mod:`~remote_g2.protocol.rank_types`. Adapters add their
own conversations to the same table when imported (the reference engine's
``adapters/reference/messages.py``, the vLLM connector's ranks). The core's
messages and rank types (not the field types) are re-exported here, as they
were all declared here before the split.
"""

from __future__ import annotations

from remote_g2.protocol.core_messages import ErrorReply, Ping, Pong
from remote_g2.protocol.rank_types import BlockLayout, GatherSlot, GatherWish, RankBlocks, RankInfo
from remote_g2.protocol.registry_messages import (
    BlockEvent,
    DrainWorker,
    DrainWorkerReply,
    Events,
    EventsReply,
    FeedInfo,
    FeedInfoReply,
    FeedTick,
    Heartbeat,
    HeartbeatReply,
    Holder,
    LayoutFingerprint,
    ListWorkers,
    ListWorkersReply,
    Lookup,
    LookupReason,
    LookupReply,
    RegisterWorker,
    RegisterWorkerReply,
    Resync,
    ResyncReply,
    ScanWorker,
    ScanWorkerReply,
    Stats,
    StatsReply,
    WhoHas,
    WhoHasReply,
    WorkerInfo,
    WorkerInfoReply,
    WorkerRecord,
    WorkerKind,
    WorkerStatus,
)
from remote_g2.protocol.sibling_messages import (
    MAX_FORWARDED_RESOLVE_BYTES,
    SiblingAck,
    SiblingPin,
    SiblingPinReply,
    SiblingRelease,
    SiblingRenew,
    SiblingResolve,
    SiblingTrim,
)
from remote_g2.protocol.source_messages import (
    ChunkTable,
    ChunkTableReply,
    GetMetadata,
    PeerResolve,
    PeerResolveReply,
    Release,
    ReleaseReply,
    Renew,
    RenewReply,
    Resolve,
    ResolveReason,
    ResolveReply,
    SourceMetadataReply,
)
from remote_g2.protocol.spec import MESSAGES, MessageSpec, message, spec_for_request
from remote_g2.protocol.target_rank_messages import LinkHello, TargetDone, TargetLoad

__all__ = [
    # the table (spec.py)
    "MESSAGES",
    "MessageSpec",
    "message",
    "spec_for_request",
    # core_messages.py
    "ErrorReply",
    "Ping",
    "Pong",
    # registry_messages.py
    "BlockEvent",
    "DrainWorker",
    "DrainWorkerReply",
    "Events",
    "EventsReply",
    "FeedInfo",
    "FeedInfoReply",
    "FeedTick",
    "Heartbeat",
    "HeartbeatReply",
    "Holder",
    "LayoutFingerprint",
    "ListWorkers",
    "ListWorkersReply",
    "Lookup",
    "LookupReason",
    "LookupReply",
    "RegisterWorker",
    "RegisterWorkerReply",
    "Resync",
    "ResyncReply",
    "ScanWorker",
    "ScanWorkerReply",
    "Stats",
    "StatsReply",
    "WhoHas",
    "WhoHasReply",
    "WorkerInfo",
    "WorkerInfoReply",
    "WorkerRecord",
    "WorkerKind",
    "WorkerStatus",
    # rank_types.py
    "BlockLayout",
    "GatherSlot",
    "GatherWish",
    "RankBlocks",
    "RankInfo",
    # source_messages.py
    "ChunkTable",
    "ChunkTableReply",
    "GetMetadata",
    "PeerResolve",
    "PeerResolveReply",
    "Release",
    "ReleaseReply",
    "Renew",
    "RenewReply",
    "Resolve",
    "ResolveReason",
    "ResolveReply",
    "SourceMetadataReply",
    # sibling_messages.py
    "MAX_FORWARDED_RESOLVE_BYTES",
    "SiblingAck",
    "SiblingPin",
    "SiblingPinReply",
    "SiblingRelease",
    "SiblingRenew",
    "SiblingResolve",
    "SiblingTrim",
    # target_rank_messages.py
    "LinkHello",
    "TargetDone",
    "TargetLoad",
]
