"""Rank 0's lease RPCs: ``resolve``, ``release``, ``renew`` and ``get_metadata``, fanned out to the TP siblings.

Resolve on rank 0 (no lock is held across the fan-out, so concurrent
resolves proceed in parallel):

* as the request arrives, before rank 0 decodes it, its frame goes to every
  sibling as ``sibling_resolve`` (each decodes and checks it as rank 0 would,
  and pins); rank 0 decodes it meanwhile — the siblings' work no longer waits
  for rank 0's (a frame rank 0 refuses is refused by the siblings too, and
  rank 0 releases the lease on them anyway);
* reserve up to one budget block per asked hash (atomically; none left →
  ``over_budget``, and the siblings' pins are released) and pin that many
  locally while the siblings work (a sibling that pinned more is trimmed
  below, so the budget bounds the leases once the resolve returns);
* any sibling error or timeout → drop the lease everywhere (siblings that
  pinned get ``sibling_release``; the others' own lease tables expire it)
  and answer ``ERR SourceError`` naming the rank;
* ``matched`` = the shortest prefix any rank pinned; longer ones are trimmed
  (``sibling_trim``, local unpin of the tail) before the reply; 0 → ``miss``
  with every pin dropped.

:class:`Rank0Handlers` is an object of its own: :class:`~.service.SourceService`
builds it once the TP group's records are in (rank 0 only), handing it the
lease table, pin budget, sibling links, gatherer, metrics and the worker's
metadata, and registers its methods on rank 0's servers. The handlers are
the lease protocol; the service is the rank's start-up and lifetime (it
owns, and closes, everything it handed over).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from remote_g2.errors import SourceError, TransportError
from remote_g2.protocol.messages import (
    MAX_FORWARDED_RESOLVE_BYTES, GetMetadata, RankBlocks, RankInfo, Release, ReleaseReply, Renew, RenewReply,
    Resolve, ResolveReply, SiblingPin, SiblingPinReply, SiblingRelease, SiblingRenew, SiblingResolve, SiblingTrim,
    SourceMetadataReply,
)
from remote_g2.rpc.server import CallContext

from .peer import owner_of
from .siblings import PendingCalls

if TYPE_CHECKING:
    from .config import SourceConfig
    from .gather import Gatherer
    from .leases import LeaseTable, PinBudget
    from .metrics import SourceMetrics
    from .siblings import SiblingLinks

log = logging.getLogger("remote_g2.source")


@dataclass(slots=True)
class _Forwarded:
    """A resolve whose frame rank 0 sent its siblings as it arrived (``sibling_resolve``), not yet decoded.

    ``sent``: ``time.monotonic()`` before the send, where rank 0 starts the
    lease's clock (each sibling starts its own on receipt, later, so it
    outlives rank 0's). :meth:`abandon` (the server refused the frame):
    release whatever the siblings pinned.
    """

    lease_id: int
    owner: bytes
    sent: float
    pending: PendingCalls
    undo: Callable[[int, dict[int, Any], bytes], None]

    def abandon(self) -> None:
        self.undo(self.lease_id, self.pending.wait(), self.owner)


class Rank0Handlers:
    """The handlers rank 0 serves to targets, over the rank's lease state; built by :class:`~.service.SourceService`.

    ``rank_infos`` is the worker's metadata (one :class:`RankInfo` per rank,
    in rank order), answered by ``get_metadata`` and, less what the caller
    knows, by every resolve; the service may fill in rank 0's peer endpoint
    once its lane is bound (before the worker endpoint serves).
    """

    def __init__(self, *, worker_id: str, epoch: int, tp_size: int, config: SourceConfig, metrics: SourceMetrics,
                 budget: PinBudget, leases: LeaseTable, links: SiblingLinks, gatherer: Gatherer | None,
                 rank_infos: list[RankInfo]) -> None:
        self.worker_id = worker_id
        self.epoch = epoch
        self.tp_size = tp_size
        self.config = config
        self.metrics = metrics
        self.budget = budget
        self.leases = leases
        self.gatherer = gatherer
        self.rank_infos = rank_infos
        self._links = links

    def get_metadata(self, req: GetMetadata, ctx: CallContext) -> SourceMetadataReply:
        return SourceMetadataReply(self.worker_id, self.epoch, self.tp_size, list(self.rank_infos))

    def forward_resolve(self, owner: bytes | None, frame: bytes) -> _Forwarded | None:
        """The arrival hook of ``resolve``: send the undecoded frame to every sibling (None: not sent).

        Each sibling's share belongs to ``owner``, the identity of the connection the frame came on.
        """
        links = self._links
        if not owner or not links.ranks or len(frame) > MAX_FORWARDED_RESOLVE_BYTES or links.down():
            return None  # the handler takes the sibling_pin path (or fails fast on a rank that is down)
        # Random, not sequential: a reader that mixes up its ids must not be able to release
        # (and so expose to overwriting) another reader's blocks. A clash is refused by the tables.
        lease_id = secrets.randbits(62) + 1
        sent = time.monotonic()
        return _Forwarded(lease_id, owner, sent,
                          links.begin(lambda r: SiblingResolve(lease_id, frame, owner), fail_fast=True), self._undo)

    def resolve(self, req: Resolve, ctx: CallContext) -> ResolveReply:
        t0 = time.perf_counter()
        try:
            reply = self._resolve_pins(req, owner_of(ctx), ctx.arrival)
        except Exception:
            self.metrics.resolve_outcome("error", time.perf_counter() - t0)
            raise
        self.metrics.resolve_outcome(reply.reason, time.perf_counter() - t0, reply.matched)
        return reply

    def _resolve_pins(self, req: Resolve, owner: bytes, forwarded: _Forwarded | None) -> ResolveReply:
        links = self._links
        ttl_ms = self.config.lease_ttl_ms(req.ttl_ms)
        # The siblings start their clocks later (on receipt): they outlive us.
        deadline = (forwarded.sent if forwarded is not None else time.monotonic()) + ttl_ms / 1000.0
        if forwarded is None:
            down = links.down()
            if down:
                raise SourceError(f"TP rank{'s' if len(down) > 1 else ''} {', '.join(map(str, down))} of "
                                  f"{self.worker_id} failed recently; failing fast for "
                                  f"{self.config.sibling_retry_after_ms} ms before trying again")
        granted = self.budget.reserve(len(req.hashes))
        if granted == 0:
            if forwarded is not None:
                self._undo(forwarded.lease_id, forwarded.pending.wait(), owner)
            return ResolveReply("over_budget", 0, 0, self.epoch, 0)
        hashes = req.hashes if granted == len(req.hashes) else req.hashes[:granted]
        if forwarded is not None:
            lease_id, pending = forwarded.lease_id, forwarded.pending
        else:  # no siblings, or a frame too large to forward
            lease_id = secrets.randbits(62) + 1  # random: see forward_resolve
            pending = links.begin(lambda r: SiblingPin(lease_id, hashes, ttl_ms, owner), fail_fast=True)
        try:
            local = self.leases.pin(lease_id, hashes, deadline, owner, worker_wide=True)
        except BaseException:
            self.budget.give_back(granted)
            self._undo(lease_id, pending.wait(), owner)
            raise
        self.budget.give_back(granted - len(local))
        # Rank 0 stages its parts while the siblings pin (and stage) theirs.
        staged = {0: self.gatherer.stage(lease_id, local, req.gather) if self.gatherer is not None else []}
        answers = pending.wait()
        failed = {r: a for r, a in answers.items() if isinstance(a, BaseException)}
        if failed:
            self._undo(lease_id, answers, owner)
            raise SourceError("resolve failed, lease undone on every rank: "
                              + "; ".join(f"TP rank {r}: {type(e).__name__}: {e}" for r, e in sorted(failed.items())))
        per_rank: dict[int, list[int]] = {0: local}
        per_rank.update({r: list(a.block_ids) for r, a in answers.items()})
        staged.update({r: a.staged for r, a in answers.items()})
        matched = min(len(ids) for ids in per_rank.values())
        if matched == 0:
            self._undo(lease_id, answers, owner)
            return ResolveReply("miss", 0, 0, self.epoch, 0)
        longer = [r for r, ids in answers.items() if len(ids.block_ids) > matched]
        if len(local) > matched:
            self.leases.trim(lease_id, matched)
        if longer:
            trims = links.call_all(lambda r: SiblingTrim(lease_id, matched), longer)
            failed = {r: a for r, a in trims.items() if isinstance(a, BaseException) or not a.known}
            if failed:
                self._undo(lease_id, answers, owner)
                raise SourceError("resolve failed while trimming, lease undone on every rank: "
                                  + "; ".join(f"TP rank {r}: {a}" for r, a in sorted(failed.items())))
        expires_in_ms = int((deadline - time.monotonic()) * 1000)
        if expires_in_ms <= 0 or self.leases.get(lease_id) is None:
            # It expired (or was released by a reader that guessed its id) while we worked.
            self._undo(lease_id, answers, owner)
            raise SourceError(f"lease expired before the resolve finished (ttl {ttl_ms} ms); ask for a longer ttl")
        # A caller that knows an agent already holds its RankInfo for this epoch: leave it out
        # (decoding the layouts again costs the target a little on every load).
        known = set(req.known_agents)
        metadata = [info for info in self.rank_infos if info.agent_name not in known]
        blocks = [RankBlocks(r, ids[:matched], [replace(s, blocks=min(s.blocks, matched)) for s in staged[r]])
                  for r, ids in sorted(per_rank.items())]
        return ResolveReply("ok", lease_id, matched, self.epoch, expires_in_ms, blocks, metadata)

    def _undo(self, lease_id: int, answers: dict[int, Any], owner: bytes) -> None:
        """Drop a lease everywhere: locally, and on every sibling that holds (or may hold) pins for it.

        Siblings that answered are released synchronously (fast, and the ERR
        reply then means "nothing is pinned"); those that did not answer may
        still pin late, so they get a release in the background (their
        tombstone refuses a pin that arrives after it, and their own expiry
        covers the rest).
        """
        self.leases.release(lease_id, owner)
        answered = [r for r, a in answers.items() if not isinstance(a, BaseException)
                    and not (isinstance(a, SiblingPinReply) and not a.block_ids)]
        unsure = [r for r, a in answers.items() if isinstance(a, TransportError)]
        if answered:
            self._links.call_all(lambda r: SiblingRelease(lease_id, owner), answered)
        if unsure:
            self._links.begin(lambda r: SiblingRelease(lease_id, owner), unsure)  # not waited for

    def release(self, req: Release, ctx: CallContext) -> ReleaseReply:
        """Unpin locally, tell every sibling, answer: the siblings' acks are not waited for.

        Each sibling drops its pins when the message arrives (a fraction of a
        millisecond later); one that cannot be reached drops them at the
        lease's expiry. Waiting would add a sibling round trip to every
        release for a guarantee no reader needs: the reader is done with the
        blocks once it releases them.
        """
        # Only the connection that resolved a lease may end it, on any rank: a reader that knows (or
        # guesses) another's lease id cannot expose that reader's blocks to eviction mid-READ.
        owner = owner_of(ctx)
        lease = self.leases.release_lease(req.lease_id, owner)
        if lease is None:
            return ReleaseReply(False)
        self.metrics.leases_released.inc()
        if self._links.ranks and lease.worker_wide:  # a peer_resolve share is this rank's alone
            self._links.begin(lambda r: SiblingRelease(req.lease_id, owner))
        return ReleaseReply(True)

    def renew(self, req: Renew, ctx: CallContext) -> RenewReply:
        ttl_ms = self.config.lease_ttl_ms(req.ttl_ms)
        deadline = time.monotonic() + ttl_ms / 1000.0
        owner = owner_of(ctx)
        lease = self.leases.get(req.lease_id)
        if not self.leases.renew(req.lease_id, deadline, owner):
            return RenewReply(False, 0)
        assert lease is not None
        if self._links.ranks and lease.worker_wide:  # a peer_resolve share is this rank's alone
            answers = self._links.call_all(lambda r: SiblingRenew(req.lease_id, ttl_ms, owner))
            lost = {r: a for r, a in answers.items() if isinstance(a, BaseException) or not a.known}
            if lost:
                # A rank whose copy is gone (or may be) cannot vouch for its blocks: end the lease.
                log.warning("lease %d: renew failed on TP rank(s) %s; releasing it", req.lease_id, sorted(lost))
                self._undo(req.lease_id, answers, owner)
                return RenewReply(False, 0)
        return RenewReply(True, max(0, int((deadline - time.monotonic()) * 1000)))
