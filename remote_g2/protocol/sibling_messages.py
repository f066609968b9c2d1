"""The sibling fan-out: a source worker's rank 0 → its ranks r > 0, over the worker's private IPC sockets.

Rank 0 pins a lease's share on every sibling (``sibling_pin``, or
``sibling_resolve`` with the target's ``resolve`` frame as received), then
trims every share to the prefix all ranks hold (``sibling_trim``) and
releases or renews them with the lease (``sibling_release``,
``sibling_renew``). Every share belongs to the connection (``owner``) that
asked rank 0 for the lease.

Registered in the one table (:mod:`remote_g2.protocol.messages`); ``docs/protocol.md``
"Sibling messages" lists them for people.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from remote_g2.protocol.rank_types import GatherWish, Staged
from remote_g2.protocol.schema import BlockHash, Limits
from remote_g2.protocol.spec import BlockIds, Count, Ttl, message

#: The identity of the connection a lease belongs to, as rank 0's server drew it
#: (remote_g2/rpc/connection_identity.py); rank 0 hands it to its siblings so that every share is bound to it.
_Owner = Annotated[bytes, Limits(min_len=1, max_len=256)]


@dataclass(frozen=True, slots=True)
class SiblingPinReply:
    """Block ids this rank pinned under the lease, for the longest prefix it holds, and what it staged."""

    block_ids: BlockIds
    staged: Staged = field(default_factory=list)


@message("sibling_pin", reply=SiblingPinReply)
@dataclass(frozen=True, slots=True)
class SiblingPin:
    """Find-and-pin ``hashes`` on this rank under ``lease_id`` until ``ttl_ms`` passes, for ``owner``."""

    lease_id: Annotated[int, Limits(ge=1)]
    hashes: Annotated[list[BlockHash], Limits(min_len=1, max_len=65_536)]
    ttl_ms: Ttl
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
    keep: Count


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
    ttl_ms: Ttl
    owner: _Owner
