"""A target rank > 0 resolving its own share with its peer source rank (``peer_resolve``), then loading it.

The leader sends such a rank a ``target_load`` whose ``peer`` field is the
``peer_resolve`` request it sends source rank 0 for its own share (one lease
id and the same hashes for every rank), before it sends that one (docs/target.md,
"Peer resolve"). This rank then, on its serving loop's thread:

1. asks its peer source rank (``RankInfo.peer_endpoint``, from the
   metadata it already holds for that source epoch) for ``peer_resolve``
   through the loop's :class:`~remote_g2.rpc_mux.RpcMux` — the loop keeps
   serving meanwhile;
2. on ``ok`` of the same epoch, hands the worker the load with its own
   ``RankBlocks`` and the destination blocks cut to the prefix its peer
   pinned (``TargetDone.blocks`` tells the leader how many);
3. after the worker reported the load, releases the share on the peer rank
   (successful or not; the leader's ``release`` at rank 0 reaches it too —
   the second one is a no-op — but rank 0 cannot when it pinned nothing).

Anything else — no answer within ``rpc_timeout_ms``, ``ERR``, a different
epoch (the source restarted), a miss, no peer endpoint — reports the share
failed at once, with ``peer_failed`` set when the call itself failed, so the
leader stops using peer resolve for that source.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from remote_g2.messages import RankBlocks, Release, TargetDone, TargetLoad
from remote_g2.rpc_mux import RpcMux

from .rank_worker import RankWorker

__all__ = ["PeerShares"]

log = logging.getLogger("remote_g2.target")


class PeerShares:
    """Peer-resolved loads of one target rank; every method runs on that rank's loop thread."""

    def __init__(self, *, rank: int, worker: RankWorker, mux: RpcMux,
                 report: Callable[[TargetDone], None]) -> None:
        self.rank = rank
        self._worker = worker
        self._mux = mux
        self._report = report
        self._leases: dict[int, tuple[str, int]] = {}  # load id -> (peer endpoint, lease id), until reported

    def start(self, load: TargetLoad, received: float) -> None:
        """Resolve ``load``'s share (``load.peer`` set) with this rank's peer; the load starts on the answer."""
        ask = load.peer
        assert ask is not None
        info = self._worker.source_info(load.source_worker, load.source_epoch, self.rank)
        if info is None or not info.peer_endpoint:
            self._fail(load, f"no peer endpoint known for rank {self.rank} of {load.source_worker} "
                             f"(epoch {load.source_epoch})", peer_failed=True)
            return
        endpoint = info.peer_endpoint

        def on_reply(reply: Any) -> None:
            where = f"peer_resolve on {load.source_worker} rank {self.rank}"
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
                self._leases[load.load_id] = (endpoint, ask.lease_id)
                self._worker.start(replace(load, ranks=[RankBlocks(self.rank, reply.block_ids)],
                                           dst_block_ids=load.dst_block_ids[:reply.matched], peer=None), received)

        self._mux.call(endpoint, ask, on_reply)  # the leader's request, as it sent it to source rank 0

    def reported(self, done: TargetDone) -> None:
        """The worker reported load ``done.load_id``: hand its share back to the peer rank."""
        lease = self._leases.pop(done.load_id, None)
        if lease is not None:
            self._release(*lease)

    def _release(self, endpoint: str, lease_id: int) -> None:
        def on_release(reply: Any) -> None:
            if isinstance(reply, Exception):  # the lease expires on the source on its own
                log.warning("target rank %d: releasing lease %d at %s: %s", self.rank, lease_id, endpoint, reply)

        self._mux.call(endpoint, Release(lease_id), on_release)

    def _fail(self, load: TargetLoad, why: str, *, peer_failed: bool = False) -> None:
        log.warning("target rank %d: load %d: %s", self.rank, load.load_id, why)
        self._report(TargetDone(load.load_id, self.rank, False, why[:4000], peer_failed=peer_failed))
