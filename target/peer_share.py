"""A target rank resolving its own share with the source ranks it reads (``peer_resolve``), then loading it.

The leader sends every rank > 0 a ``target_load`` whose ``peer`` field is
the ``peer_resolve`` request it sends for its own share, before it sends
that one (docs/target.md, "Peer resolve"). A rank's peers are the source
ranks it reads from (:func:`~remote_g2.tp.head_slices.source_ranks_for`: its
namesake at the same TP size; at a larger one, or for MLA, the one rank
holding what it reads, which other target ranks read too; at a smaller
one, several). A rank > 0 then, on its serving loop's thread
(:class:`PeerShares`; the leader does the same on the coordinator's):

1. asks each of its peers (``RankInfo.peer_endpoint``, from the metadata
   it already holds for that source epoch) for ``peer_resolve`` at once,
   through the loop's :class:`~remote_g2.rpc.mux.RpcMux` — the loop keeps
   serving meanwhile — under the lease id ``L + rank``
   (:func:`share_request`: a lease id opens once per source rank, and
   several target ranks may ask one) and staging only its own part;
2. once every peer answered ``ok`` in the same epoch, hands the worker the
   load with each peer's ``RankBlocks`` and the destination blocks cut to
   the shortest prefix they pinned (:func:`combine`; ``TargetDone.blocks``
   tells the leader how many);
3. renews each share when the load outlives half its TTL, and reports the
   load failed when a share may have lapsed before the READ ended (renew
   refused, or the share's expiry passed: its clock is taken from when
   ``peer_resolve`` was sent, so it never runs late);
4. after the worker reported the load, releases every share (successful or
   not). Only this rank can renew or release them: a share belongs to this
   rank's connection to its peer, and the leader's ``renew`` / ``release``
   do not reach it (docs/security.md).

Anything else — no answer within ``rpc_timeout_ms``, ``ERR``, a different
epoch (the source restarted), a miss, no peer endpoint — releases what the
other peers pinned and reports the share failed at once, with
``peer_failed`` set when a call itself failed, so the leader stops using
peer resolve for that source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from remote_g2.tp.head_slices import source_ranks_for
from remote_g2.protocol.messages import PeerResolve as PeerResolveRequest
from remote_g2.protocol.messages import RankBlocks, RankInfo, Release, Renew, TargetDone, TargetLoad
from remote_g2.rpc.mux import RpcMux

from .load import LeaseClock
from .rank_worker import RankWorker

__all__ = ["PeerAnswers", "PeerShares", "ask_peers", "combine", "peer_endpoints", "share_request"]

log = logging.getLogger("remote_g2.target")


def peer_endpoints(target_rank: int, info_of: Callable[[int], RankInfo | None], *, source_tp: int, target_tp: int,
                   is_mla: bool, mla_offset: int, rank0_endpoint: str | None = None) -> dict[int, str | None]:
    """Where ``target_rank`` asks each source rank it reads for its share: the rank's peer endpoint
    (``info_of(rank)``'s), else, for source rank 0, ``rank0_endpoint`` — the worker's endpoint, which only the
    leader reaches (rank 0 answers the leader's calls there); None where there is neither.

    The one rule behind the leader's check that a load can go by peer resolve
    (:meth:`~.source_directory.SourceDirectory.peer_ready`), the leader's own
    calls (:class:`~.resolve_strategies.PeerResolve`) and every other rank's
    (:class:`PeerShares`).
    """
    out: dict[int, str | None] = {}
    for s in source_ranks_for(target_rank, source_tp=source_tp, target_tp=target_tp, is_mla=is_mla,
                              mla_offset=mla_offset):
        info = info_of(s)
        out[s] = (info.peer_endpoint if info is not None else None) or (rank0_endpoint if s == 0 else None)
    return out


def share_request(ask: PeerResolveRequest, target_rank: int) -> PeerResolveRequest:
    """The leader's ``peer_resolve`` as target rank ``target_rank`` sends it: under the lease id ``lease_id +
    target_rank`` (two target ranks may share a source rank, and a lease id is opened once per rank) and
    asking to stage only what this rank reads."""
    gather = None if ask.gather is None else replace(ask.gather, target_rank=target_rank)
    return replace(ask, lease_id=ask.lease_id + target_rank, gather=gather)


@dataclass
class PeerAnswers:
    """What the source ranks of one target rank's share answered, taken together (:func:`combine`).

    ``error`` empty: every rank pinned; each rank's ``RankBlocks`` cut to the
    shortest prefix any of them pinned (``matched``) — a target rank reading
    several source ranks loads only blocks every one of them holds.
    ``pinned``: the source ranks that pinned something (to release when the
    share fails); ``peer_failed``: a call itself failed (no answer, ``ERR``,
    refused); ``restarted``: a rank answered an epoch other than the one
    expected.
    """

    ranks: list[RankBlocks]
    matched: int = 0
    expires_in_ms: int = 0
    error: str = ""
    peer_failed: bool = False
    restarted: bool = False
    pinned: list[int] = field(default_factory=list)


def combine(replies: dict[int, Any], epoch: int, worker: str) -> PeerAnswers:
    """Each source rank's ``peer_resolve`` reply (or the call's exception), by source rank, as one share."""
    pinned = [s for s, r in sorted(replies.items()) if not isinstance(r, Exception) and r.matched]
    for s, reply in sorted(replies.items()):
        where = f"peer_resolve on {worker} rank {s}"
        if isinstance(reply, Exception):
            return PeerAnswers([], error=f"{where}: {type(reply).__name__}: {reply}", peer_failed=True, pinned=pinned)
        if reply.epoch != epoch:
            return PeerAnswers([], error=f"{where}: the source restarted (epoch {reply.epoch}, expected {epoch})",
                               restarted=True, pinned=pinned)
        if reply.reason != "ok" or reply.matched == 0:
            return PeerAnswers([], error=f"{where}: {reply.reason}", pinned=pinned)
    matched = min(r.matched for r in replies.values())
    return PeerAnswers([RankBlocks(s, r.block_ids[:matched], r.staged) for s, r in sorted(replies.items())],
                       matched, min(r.expires_in_ms for r in replies.values()), pinned=pinned)


def ask_peers(mux: RpcMux, calls: dict[int, str], ask: PeerResolveRequest,
              on_all: Callable[[dict[int, Any]], None]) -> None:
    """Send ``ask`` to every source rank in ``calls`` (rank → endpoint) at once; ``on_all(replies)`` once
    every one answered (a reply, or the call's exception)."""
    replies: dict[int, Any] = {}

    def answer(rank: int) -> Callable[[Any], None]:
        def on_reply(reply: Any) -> None:
            replies[rank] = reply
            if len(replies) == len(calls):
                on_all(replies)
        return on_reply

    for rank, endpoint in calls.items():
        mux.call(endpoint, ask, answer(rank))


@dataclass
class _Share(LeaseClock):
    """A share this rank holds on one source rank, until its load is reported: its lease's clock
    (as the leader keeps one per load) and why its pins may be gone (renew refused: the load must fail)."""

    lapsed: str = ""


class PeerShares:
    """Peer-resolved loads of one target rank; every method runs on that rank's loop thread.

    ``ttl_ms``: what a renewal asks for (the target's ``lease_ttl_ms``).
    """

    def __init__(self, *, rank: int, worker: RankWorker, mux: RpcMux,
                 report: Callable[[TargetDone], None], ttl_ms: int = 10_000) -> None:
        self.rank = rank
        self._worker = worker
        self._mux = mux
        self._report = report
        self._ttl_ms = ttl_ms
        self._leases: dict[int, list[_Share]] = {}  # load id -> its shares (one per source rank), until reported

    def start(self, load: TargetLoad, received: float) -> None:
        """Resolve ``load``'s share (``load.peer`` set) with the source ranks this rank reads; the load starts
        once every one answered."""
        assert load.peer is not None
        known = peer_endpoints(self.rank, lambda s: self._worker.source_info(load.source_worker, load.source_epoch, s),
                               source_tp=load.source_tp, target_tp=self._worker.tp_size, is_mla=load.is_mla,
                               mla_offset=load.mla_offset)
        missing = [s for s, e in known.items() if not e]
        if missing:
            self._fail(load, f"no peer endpoint known for rank {missing[0]} of {load.source_worker} "
                             f"(epoch {load.source_epoch})", peer_failed=True)
            return
        endpoints = {s: e for s, e in known.items() if e}
        ask = share_request(load.peer, self.rank)

        def on_all(replies: dict[int, Any]) -> None:
            got = combine(replies, load.source_epoch, load.source_worker)
            if got.error:
                for s in got.pinned:
                    self._release(endpoints[s], ask.lease_id)
                self._fail(load, got.error, peer_failed=got.peer_failed)
                return
            shares = self._leases[load.load_id] = [_Share(ask.lease_id, endpoints[s]) for s in sorted(replies)]
            for share in shares:
                share.granted(sent, got.expires_in_ms)
            self._worker.start(replace(load, ranks=got.ranks, dst_block_ids=load.dst_block_ids[:got.matched],
                                       peer=None), received)

        sent = time.monotonic()
        ask_peers(self._mux, endpoints, ask, on_all)

    def vouch(self, done: TargetDone) -> TargetDone:
        """``done`` as the leader must hear it: a success whose share may have lapsed becomes a failure."""
        shares = self._leases.get(done.load_id)
        if not shares or not done.ok:
            return done
        now = time.monotonic()
        why = next((s.lapsed for s in shares if s.lapsed), "") or (
            "" if all(now < s.expires for s in shares) else
            "the share's lease on a peer source rank expired before the load finished")
        if not why:
            return done
        log.warning("target rank %d: load %d: %s", self.rank, done.load_id, why)
        return replace(done, ok=False, error=why, nbytes=0, descriptors=0, blocks=0)

    def reported(self, done: TargetDone) -> None:
        """The worker reported load ``done.load_id``: hand its share back to the peer rank."""
        for share in self._leases.pop(done.load_id, []):
            self._release(share.endpoint, share.lease_id)

    def tick(self, now: float) -> None:
        """Renew the shares whose loads outlived half their TTL (from the rank's loop, every turn)."""
        for shares in self._leases.values():
            for share in shares:
                if not share.renewing and not share.lapsed and now >= share.renew_at:
                    self._renew(share)

    def next_due(self) -> float | None:
        """When :meth:`tick` next has work (``time.monotonic()``), or None."""
        due = [s.renew_at for shares in self._leases.values() for s in shares if not s.renewing and not s.lapsed]
        return min(due) if due else None

    def _renew(self, share: _Share) -> None:
        share.renewing = True
        sent = time.monotonic()

        def on_renewed(reply: Any) -> None:
            share.renewing = False
            if isinstance(reply, Exception):  # try again; the expiry check still guards the bytes
                log.warning("target rank %d: renewing lease %d at %s: %s", self.rank, share.lease_id,
                            share.endpoint, reply)
                share.renew_at = time.monotonic() + self._mux.timeout_ms / 1000.0
            elif not reply.renewed:
                share.lapsed = "the peer source rank dropped the share before the load finished"
            else:
                share.granted(sent, reply.expires_in_ms)

        self._mux.call(share.endpoint, Renew(share.lease_id, self._ttl_ms), on_renewed)

    def _release(self, endpoint: str, lease_id: int) -> None:
        def on_release(reply: Any) -> None:
            if isinstance(reply, Exception):  # the lease expires on the source on its own
                log.warning("target rank %d: releasing lease %d at %s: %s", self.rank, lease_id, endpoint, reply)

        self._mux.call(endpoint, Release(lease_id), on_release)

    def _fail(self, load: TargetLoad, why: str, *, peer_failed: bool = False) -> None:
        log.warning("target rank %d: load %d: %s", self.rank, load.load_id, why)
        self._report(TargetDone(load.load_id, self.rank, False, why[:4000], peer_failed=peer_failed))
