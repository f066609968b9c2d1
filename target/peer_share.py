"""A target rank > 0 resolving its own share with its peer source rank (``peer_resolve``), then loading it.

The leader sends such a rank a ``target_load`` whose ``peer`` field is the
``peer_resolve`` request it sends source rank 0 for its own share, before it
sends that one (docs/target.md, "Peer resolve"). A rank's peer is the one
source rank it reads from (:func:`~remote_g2.head_slices.peer_rank`: its namesake at the same TP
size; at a TP size that is a multiple of the source's, the rank holding its
heads, which other target ranks read from too). This rank then, on its
serving loop's thread:

1. asks its peer source rank (``RankInfo.peer_endpoint``, from the
   metadata it already holds for that source epoch) for ``peer_resolve``
   through the loop's :class:`~remote_g2.rpc_mux.RpcMux` — the loop keeps
   serving meanwhile — under the lease id ``L + rank`` (:func:`share_request`:
   a lease id opens once per source rank) and staging only its own part;
2. on ``ok`` of the same epoch, hands the worker the load with its own
   ``RankBlocks`` and the destination blocks cut to the prefix its peer
   pinned (``TargetDone.blocks`` tells the leader how many);
3. renews the share on the peer rank when the load outlives half its TTL,
   and reports the load failed when the share may have lapsed before the
   READ ended (renew refused, or the share's expiry passed: its clock is
   taken from when ``peer_resolve`` was sent, so it never runs late);
4. after the worker reported the load, releases the share on the peer rank
   (successful or not). Only this rank can renew or release it: the share
   belongs to this rank's connection to its peer, and the leader's
   ``renew`` / ``release`` at source rank 0 do not reach it (docs/security.md).

Anything else — no answer within ``rpc_timeout_ms``, ``ERR``, a different
epoch (the source restarted), a miss, no peer endpoint — reports the share
failed at once, with ``peer_failed`` set when the call itself failed, so the
leader stops using peer resolve for that source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from remote_g2.head_slices import peer_rank
from remote_g2.messages import PeerResolve as PeerResolveRequest
from remote_g2.messages import RankBlocks, Release, Renew, TargetDone, TargetLoad
from remote_g2.rpc_mux import RpcMux

from .load import LeaseClock
from .rank_worker import RankWorker

__all__ = ["PeerShares", "share_request"]

log = logging.getLogger("remote_g2.target")


def share_request(ask: PeerResolveRequest, target_rank: int) -> PeerResolveRequest:
    """The leader's ``peer_resolve`` as target rank ``target_rank`` sends it: under the lease id ``lease_id +
    target_rank`` (two target ranks may share a source rank, and a lease id is opened once per rank) and
    asking to stage only what this rank reads."""
    gather = None if ask.gather is None else replace(ask.gather, target_rank=target_rank)
    return replace(ask, lease_id=ask.lease_id + target_rank, gather=gather)


@dataclass
class _Share(LeaseClock):
    """A share this rank holds on its peer source rank, until its load is reported: its lease's clock
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
        self._leases: dict[int, _Share] = {}  # load id -> its share, until reported

    def start(self, load: TargetLoad, received: float) -> None:
        """Resolve ``load``'s share (``load.peer`` set) with this rank's peer; the load starts on the answer."""
        assert load.peer is not None
        peer = peer_rank(self.rank, load.source_tp, self._worker.tp_size)
        info = self._worker.source_info(load.source_worker, load.source_epoch, peer)
        if info is None or not info.peer_endpoint:
            self._fail(load, f"no peer endpoint known for rank {peer} of {load.source_worker} "
                             f"(epoch {load.source_epoch})", peer_failed=True)
            return
        endpoint = info.peer_endpoint
        ask = share_request(load.peer, self.rank)

        def on_reply(reply: Any) -> None:
            where = f"peer_resolve on {load.source_worker} rank {peer}"
            if isinstance(reply, Exception):
                self._fail(load, f"{where}: {type(reply).__name__}: {reply}", peer_failed=True)
            elif reply.epoch != load.source_epoch:
                if reply.matched:
                    self._release(endpoint, ask.lease_id)
                self._fail(load, f"{where}: the source restarted (epoch {reply.epoch}, expected "
                                 f"{load.source_epoch})")
            elif reply.reason != "ok" or reply.matched == 0:
                self._fail(load, f"{where}: {reply.reason}")
            else:
                share = self._leases[load.load_id] = _Share(ask.lease_id, endpoint)
                share.granted(sent, reply.expires_in_ms)
                self._worker.start(replace(load, ranks=[RankBlocks(peer, reply.block_ids, reply.staged)],
                                           dst_block_ids=load.dst_block_ids[:reply.matched], peer=None), received)

        sent = time.monotonic()
        self._mux.call(endpoint, ask, on_reply)

    def vouch(self, done: TargetDone) -> TargetDone:
        """``done`` as the leader must hear it: a success whose share may have lapsed becomes a failure."""
        share = self._leases.get(done.load_id)
        if share is None or not done.ok:
            return done
        why = share.lapsed or ("" if time.monotonic() < share.expires else
                               "the share's lease on the peer source rank expired before the load finished")
        if not why:
            return done
        log.warning("target rank %d: load %d: %s", self.rank, done.load_id, why)
        return replace(done, ok=False, error=why, nbytes=0, descriptors=0, blocks=0)

    def reported(self, done: TargetDone) -> None:
        """The worker reported load ``done.load_id``: hand its share back to the peer rank."""
        share = self._leases.pop(done.load_id, None)
        if share is not None:
            self._release(share.endpoint, share.lease_id)

    def tick(self, now: float) -> None:
        """Renew the shares whose loads outlived half their TTL (from the rank's loop, every turn)."""
        for share in self._leases.values():
            if not share.renewing and not share.lapsed and now >= share.renew_at:
                self._renew(share)

    def next_due(self) -> float | None:
        """When :meth:`tick` next has work (``time.monotonic()``), or None."""
        due = [s.renew_at for s in self._leases.values() if not s.renewing and not s.lapsed]
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
