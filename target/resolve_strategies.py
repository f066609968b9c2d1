"""How a load's lease is taken and every target rank handed its share: two strategies behind one interface.

* :class:`ClassicResolve` — source rank 0 resolves the whole lease
  (``resolve``: it pins on every source rank), the leader fetches metadata it
  lacks, then hands every target rank its share of the READs. Works for any
  pair of TP sizes and for MLA.
* :class:`PeerResolve` — every target rank already holds the source's
  metadata (an earlier load brought it): each target rank asks the source
  ranks it reads from (:func:`~remote_g2.tp.head_slices.source_ranks_for`: one
  at the same TP size, at a larger one and for MLA; several at a smaller
  one) for its share (``peer_resolve``, under the lease id the leader chose
  plus its rank), so the shares resolve in parallel with no hop through
  either rank 0 (docs/target.md, "Peer resolve"). The leader's own share is
  asked like any other rank's.

A strategy runs on the coordinator's thread and acts on the load only
through the :class:`~.coordinator.Coordinator` it was given: the coordinator
owns the load's state and decides what happens when the ranks report.
"""

from __future__ import annotations

import logging
import secrets
import time
from abc import ABC, abstractmethod
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from remote_g2.errors import RpcClosed, RpcTimeout, TransportError
from remote_g2.protocol.messages import GetMetadata, RankInfo, Resolve, ResolveReply, TargetDone, TargetLoad
from remote_g2.protocol.messages import PeerResolve as PeerResolveRequest

from .load import LeaseClock, Load, LoadState
from .peer_share import ask_peers, combine, peer_endpoints, share_request

if TYPE_CHECKING:
    from .client import TargetMatch
    from .coordinator import Coordinator

__all__ = ["ResolveStrategy", "ClassicResolve", "PeerResolve"]

log = logging.getLogger("remote_g2.target")


class ResolveStrategy(ABC):
    """Takes a load's lease and hands every rank its share; see the module docstring."""

    name: str

    def __init__(self, host: Coordinator) -> None:
        self.host = host

    @abstractmethod
    def start(self, load: Load, match: TargetMatch, n: int) -> None:
        """Resolve the first ``n`` blocks of ``load`` on ``match``'s source and hand the ranks their shares."""

    def rank_failed(self, load: Load, done: TargetDone) -> None:
        """A rank reported its share failed (``done``); what this strategy learns from it (nothing by default)."""


class ClassicResolve(ResolveStrategy):
    """Source rank 0 resolves every source rank's pins; then the leader dispatches the READs."""

    name = "classic"

    def start(self, load: Load, match: TargetMatch, n: int) -> None:
        host = self.host
        assert match.worker_id is not None and match.endpoint is not None
        load.enter(LoadState.RESOLVING)
        sent = time.monotonic()
        host.metrics.phase("to_resolve", sent - load.started)
        load.lease.endpoint = match.endpoint
        ask = Resolve(load.hashes[:n], host.config.lease_ttl_ms, host.worker_id,
                      host.sources.known_agents(match.worker_id), host.gather_wish(match.tp_size or 1))
        host.mux.call(match.endpoint, ask, lambda reply: self._resolved(load, reply, sent))

    def _resolved(self, load: Load, reply: Any, sent: float) -> None:
        host = self.host
        assert load.match is not None and load.match.worker_id is not None
        wid = load.match.worker_id
        host.metrics.phase("resolve", time.monotonic() - sent)
        if isinstance(reply, Exception):
            host.fail(load, f"resolve on {wid}: {type(reply).__name__}: {reply}")
            return
        load.lease.lease_id = reply.lease_id
        if not host.alive(load):  # given up meanwhile (shut down): hand the lease back
            host.send_release(load)
            return
        if reply.reason != "ok" or reply.matched == 0:
            host.fail(load, f"resolve on {wid}: {reply.reason}")
            return
        load.lease.granted(sent, reply.expires_in_ms)
        load.keep_prefix(reply.matched)
        load.source_epoch = reply.epoch
        infos, missing = host.sources.learn(wid, reply.epoch, reply.metadata)
        host.sources.came_from(wid, load.match.endpoint)
        if not missing:
            self._dispatch(load, reply, infos)
            return
        assert load.match.endpoint is not None

        def on_metadata(full: Any) -> None:
            if not host.alive(load):
                return
            if isinstance(full, Exception):
                host.fail(load, f"get_metadata on {wid}: {type(full).__name__}: {full}")
                return
            self._dispatch(load, reply, host.sources.learn(wid, reply.epoch, full.ranks)[0])

        host.mux.call(load.match.endpoint, GetMetadata(), on_metadata)

    def _dispatch(self, load: Load, reply: ResolveReply, infos: dict[int, RankInfo]) -> None:
        """Hand every rank its share: the other ranks first (no waiting for acks), then the leader's own."""
        host = self.host
        assert load.match is not None and load.match.worker_id is not None
        first_time = host.sources.first_sent(load.match.worker_id, infos)
        mla_offset = host.mla_offset(len(infos))
        is_mla = host.is_mla
        load.enter(LoadState.READING)
        # Ranks keep what they were sent per (source worker, epoch): only agents new to them travel.
        msg = TargetLoad(load.load_id, load.match.worker_id, reply.epoch, len(infos), is_mla, mla_offset,
                         reply.ranks, [info for _, info in sorted(infos.items()) if info.agent_name in first_time],
                         load.dst, host.config.transfer_timeout_ms, host.start_clocks(load),
                         request_id=load.request_id)
        host.send_to_ranks(load, msg)
        host.own_share(msg)  # the others' shares are on the wire already


class PeerResolve(ResolveStrategy):
    """Every target rank resolves its own share with the source ranks it reads, under the leader's lease id
    plus its rank."""

    name = "peer"

    def ready(self, match: TargetMatch) -> bool:
        """Whether a load from ``match``'s source can go this way (see :meth:`SourceDirectory.peer_ready`)."""
        host = self.host
        return (host.config.peer_resolve and match.worker_id is not None and match.endpoint is not None
                and host.sources.peer_ready(match.worker_id, match.endpoint, host.tp_size,
                                            is_mla=host.is_mla, mla_offset=host.mla_offset))

    def start(self, load: Load, match: TargetMatch, n: int) -> None:
        """Hand every other rank its share, then ask the source ranks the leader reads for its own.

        The other ranks go first: their chain is a hop longer (the
        ``target_load``, then their calls). Where ranks share a CPU, a rank
        woken first holds it while the leader's calls wait (the
        ``to_resolve`` phase of ``bench/transfer/bench_gather.py --cpus split``); with
        a core per rank, as in a deployment, this order is the faster one
        (``bench/transfer/bench_transfer.py --bind core``; docs/benchmarks.md).
        """
        host = self.host
        assert match.worker_id is not None and match.endpoint is not None
        wid = match.worker_id
        epoch, infos = host.sources.current(wid)
        load.source_epoch = epoch
        host.stats["peer_loads"] += 1
        load.lease.lease_id = secrets.randbits(62) + 1  # random: another reader's ids are not guessable
        load.keep_prefix(n)
        # Every rank sends it as its own share (share_request): under L + its rank, staging its own part.
        ask = PeerResolveRequest(load.lease.lease_id, load.hashes[:n], host.config.lease_ttl_ms,
                                 host.worker_id, host.gather_wish(len(infos)))
        is_mla = host.is_mla
        mla_offset = host.mla_offset(len(infos))
        load.enter(LoadState.READING)
        msg = TargetLoad(load.load_id, wid, epoch, len(infos), is_mla, mla_offset, [], [], load.dst,
                         host.config.transfer_timeout_ms, host.start_clocks(load), ask, request_id=load.request_id)
        host.send_to_ranks(load, msg)
        sent = time.monotonic()
        host.metrics.phase("to_resolve", sent - load.started)
        # Source rank 0 at its stream lane when it has one (no ZMQ I/O threads on the way), else at the
        # worker's endpoint; every other source rank at its peer endpoint.
        known = peer_endpoints(0, infos.get, source_tp=len(infos), target_tp=host.tp_size, is_mla=is_mla,
                               mla_offset=mla_offset, rank0_endpoint=match.endpoint)
        endpoints = {s: e for s, e in known.items() if e}
        assert endpoints.keys() == known.keys(), known  # peer_ready checked
        first, *others = sorted(endpoints)
        load.lease.endpoint = endpoints[first]
        load.other_shares = [LeaseClock(load.lease.lease_id, endpoints[s]) for s in others]
        ask_peers(host.mux, endpoints, share_request(ask, 0),
                  lambda replies: self._resolved(load, replies, endpoints, sent, msg))

    def _resolved(self, load: Load, replies: dict[int, Any], endpoints: dict[int, str], sent: float,
                  msg: TargetLoad) -> None:
        """The leader's share is resolved on every source rank it reads (or not): start it, or count the
        leader's share as failed (the other ranks still report)."""
        host = self.host
        assert load.match is not None and load.match.worker_id is not None
        wid = load.match.worker_id
        host.metrics.phase("resolve", time.monotonic() - sent)
        if not host.alive(load):
            return  # given up meanwhile (shut down): fail() released the leases
        got = combine(replies, load.source_epoch, wid)
        lanes_gone = any(_lane_gone(reply) and endpoints[s] != load.match.endpoint for s, reply in replies.items())
        if got.restarted or lanes_gone:
            # A rank answered another epoch, or a lane refused or dropped the connection: the source's process
            # is gone — perhaps restarted behind the same worker endpoint (a fixed port), with new lanes.
            # Once every rank has answered (the others fail their shares the same way), this load is resolved
            # again through rank 0's worker endpoint, classically, which brings the new epoch's metadata; a
            # source that is really gone fails that resolve.
            host.sources.forget(wid)
            load.resolve_again = True
            host.send_release(load)
        elif got.peer_failed:
            self._turn_off(wid, load.source_epoch, got.error)
        if got.error:
            host.rank_done(TargetDone(load.load_id, 0, False, got.error[:4000]))
            return
        for lease in load.leases():
            lease.granted(sent, got.expires_in_ms)
        host.own_share(replace(msg, ranks=got.ranks, dst_block_ids=load.dst[:got.matched], peer=None))

    def rank_failed(self, load: Load, done: TargetDone) -> None:
        if done.peer_failed and load.match is not None and load.match.worker_id is not None:
            self._turn_off(load.match.worker_id, load.source_epoch, f"rank {done.rank}: {done.error}")

    def _turn_off(self, worker: str, epoch: int, why: str) -> None:
        if self.host.sources.peer_failed(worker, epoch):
            log.warning("target: peer resolve with %s failed (%s); its loads go through rank 0's resolve from now "
                        "on (until it restarts)", worker, why)


def _lane_gone(error: Exception) -> bool:
    """A call failed because its connection was refused or dropped (not a timeout, not our own shutdown)."""
    return isinstance(error, TransportError) and not isinstance(error, (RpcTimeout, RpcClosed))
