"""A rank's own share of a lease, asked of that rank directly: ``peer_resolve``.

The classic resolve makes every target rank's share wait on the whole chain
(target rank 0 → source rank 0 → its siblings → rank 0 → target rank 0 →
the other target ranks). A target rank that already holds the source's
metadata can ask the source ranks it reads itself: it sends ``peer_resolve``
to each, under the lease id the target chose plus its own rank, and the
shares resolve in parallel — no hop through either rank 0.

What each rank does (rank 0 on its worker endpoint, rank r > 0 on its own
``peer_endpoint``, advertised in :class:`~remote_g2.protocol.messages.RankInfo`):
find-and-pin, within this rank's pin budget, the longest prefix this rank
holds under the caller's lease id (a lease id already open or released here
is refused), and answer the block ids and the worker's epoch. Ending such a lease: ``release``
or expiry on each rank. Each share belongs to the connection that pinned it
(its server-drawn identity, remote_g2/rpc/connection_identity.py): only
``release`` / ``renew`` from that connection end or extend it, on whichever
rank it lives — rank 0's fan-out to its siblings carries rank 0's caller, so
it never reaches a share another connection pinned.

Nothing here waits on another rank, so a sibling serves it on its own
direct (one-thread) server.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from remote_g2.protocol.messages import PeerResolve, PeerResolveReply, Release, ReleaseReply, Renew, RenewReply
from remote_g2.rpc.server import CallContext, Handler

from .gather import Gatherer
from .leases import LeaseTable

__all__ = ["owner_of", "peer_handlers", "resolve_share"]


def resolve_share(table: LeaseTable, req: PeerResolve, owner: bytes, *, epoch: int,
                  lease_ttl_ms: Callable[[int], int], gatherer: Gatherer | None = None) -> PeerResolveReply:
    """Pin this rank's share of ``req`` within the table's budget (see the module docstring); the reply.

    With a gather wish, ``gatherer`` stages what the asking rank reads (``source/gather.py``).
    """
    ttl_ms = lease_ttl_ms(req.ttl_ms)
    deadline = time.monotonic() + ttl_ms / 1000.0
    ids = table.pin_within_budget(req.lease_id, req.hashes, deadline, owner)
    if ids is None:
        return PeerResolveReply("over_budget", 0, epoch, 0)
    if not ids:
        return PeerResolveReply("miss", 0, epoch, 0)
    staged = gatherer.stage(req.lease_id, ids, req.gather) if gatherer is not None else []
    return PeerResolveReply("ok", len(ids), epoch, max(0, int((deadline - time.monotonic()) * 1000)), ids, staged)


def peer_handlers(table: LeaseTable, *, epoch: Callable[[], int],
                  lease_ttl_ms: Callable[[int], int], on_release: Callable[[], None] | None = None,
                  observe: Callable[[str, float, int], None] | None = None,
                  gatherer: Gatherer | None = None) -> dict[str, Handler]:
    """The handlers of a rank's peer endpoint: ``peer_resolve``, and ``release`` / ``renew`` of what a caller pinned here.

    ``epoch()``: the worker's epoch (known once the start-up exchange is
    done); ``lease_ttl_ms``: the source's TTL clamp; ``observe(outcome,
    seconds, matched)``: metrics for each resolve.
    """

    def peer_resolve(req: PeerResolve, ctx: CallContext) -> PeerResolveReply:
        t0 = time.perf_counter()
        reply = resolve_share(table, req, owner_of(ctx), epoch=epoch(), lease_ttl_ms=lease_ttl_ms, gatherer=gatherer)
        if observe is not None:
            observe(reply.reason, time.perf_counter() - t0, reply.matched)
        return reply

    def release(req: Release, ctx: CallContext) -> ReleaseReply:
        released = table.release(req.lease_id, owner_of(ctx))
        if released and on_release is not None:
            on_release()
        return ReleaseReply(released)

    def renew(req: Renew, ctx: CallContext) -> RenewReply:
        deadline = time.monotonic() + lease_ttl_ms(req.ttl_ms) / 1000.0
        if not table.renew(req.lease_id, deadline, owner_of(ctx)):
            return RenewReply(False, 0)
        return RenewReply(True, max(0, int((deadline - time.monotonic()) * 1000)))

    return {"peer_resolve": peer_resolve, "release": release, "renew": renew}


def owner_of(ctx: CallContext) -> bytes:
    """The identity a lease taken on this call belongs to; a server that does not identify clients is a bug."""
    if not ctx.identity:
        raise RuntimeError(f"{ctx.type}: this server does not identify its clients (identify_clients=True)")
    return ctx.identity
