"""The target-rank conversation: a target worker's leader (rank 0) ↔ its ranks r > 0, one-way over local links.

A rank opens its link with ``link_hello``; the leader hands each rank its
share of a resolved lease to read (``target_load``) and each rank answers
``target_done`` when its bytes landed or not. These travel only on the
worker's :mod:`~remote_g2.rpc.local_link` links, never as an RPC.

Registered in the one table (:mod:`remote_g2.protocol.messages`); ``docs/protocol.md``
"Target ranks" lists them for people.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from remote_g2.protocol.rank_types import RankBlocks, RankInfo
from remote_g2.protocol.schema import Limits
from remote_g2.protocol.source_messages import PeerResolve
from remote_g2.protocol.spec import BlockIds, Count, Epoch, Rank, Text, Ttl, WorkerId, message


@message("link_hello", reply=None)
@dataclass(frozen=True, slots=True)
class LinkHello:
    """The first message on a local link: the connecting process is TP rank ``rank`` of ``worker_id``."""

    worker_id: WorkerId
    rank: Rank


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
    source_worker: WorkerId
    source_epoch: Epoch
    source_tp: Annotated[int, Limits(ge=1, le=4096)]
    is_mla: bool
    mla_offset: Count
    ranks: Annotated[list[RankBlocks], Limits(max_len=4096)]
    metadata: Annotated[list[RankInfo], Limits(max_len=4096)]
    dst_block_ids: BlockIds
    timeout_ms: Ttl
    deadline_ns: Count = 0
    #: Set when this rank resolves its own share (``ranks`` is then empty): the ``peer_resolve`` it sends
    #: its peer source rank, as the leader sends its own. It loads the prefix its peer pinned.
    peer: PeerResolve | None = None
    #: The engine's request id, so that every rank can tell its engine how its own share ended.
    request_id: Text = ""


@message("target_done", reply=None)
@dataclass(frozen=True, slots=True)
class TargetDone:
    """A rank finished its share of load ``load_id``: every byte landed (``ok``) or not (``error``)."""

    load_id: Annotated[int, Limits(ge=1)]
    rank: Rank
    ok: bool
    error: Text = ""
    nbytes: Count = 0
    descriptors: Count = 0
    blocks: Count = 0  # leading destination blocks loaded (a peer-resolved share may be shorter than asked)
    peer_failed: bool = False  # the share's peer_resolve went unanswered or answered ERR (not a miss)
