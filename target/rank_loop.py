"""The loops that drive one rank's READs: :class:`RankLoop` on every rank > 0, :class:`ShareLoop` for the leader.

Both take ``target_load`` messages, hand them to the rank's
:class:`~.rank_worker.RankWorker` (which plans and posts the READs), poll
while READs are in flight, and report each share's outcome once: to the
leader (over the rank's local link, or the coordinator's event queue for the
leader's own share) and to this rank's own :class:`~.outcomes.Outcomes`, so
that an engine running one worker per rank learns how its own share ended.

Why the leader's share has a thread of its own: on one host NIXL copies the
bytes inside the READ post (UCX ``cma``). Posted from the coordinator, a
large READ would hold up everything else it does for that long; NIXL lets go
of the GIL while it copies, so the coordinator keeps resolving and
dispatching meanwhile.

A rank > 0 runs an event loop (:class:`~remote_g2.rpc.mux.RpcMux`) on its
link, so that a share it resolves with its peer source rank
(:class:`~.peer_share.PeerShares`) waits for its answer — and is renewed —
without holding up anything else.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable

from remote_g2.errors import ProtocolError
from remote_g2.rpc.local_link import LinkClosed, MessageLink
from remote_g2.protocol.messages import TargetDone, TargetLoad
from remote_g2.rpc.mux import RpcMux

from .config import TargetConfig
from .coordinator import RELEASE_AFTER_MS
from .outcomes import Outcomes
from .peer_share import PeerShares
from .rank_worker import POLL_S, RankWorker

__all__ = ["RankLoop", "ShareLoop", "ShareBook"]

log = logging.getLogger("remote_g2.target")


class ShareBook:
    """The shares a rank is working on (load id → request id and destination blocks), to report each one's
    outcome to this rank's engine: its request id, and the destination blocks it did not load."""

    def __init__(self, outcomes: Outcomes) -> None:
        self.outcomes = outcomes
        self._open: dict[int, tuple[str, list[int]]] = {}
        self._lock = threading.Lock()

    def opened(self, load: TargetLoad) -> None:
        if load.request_id:
            with self._lock:
                self._open[load.load_id] = (load.request_id, list(load.dst_block_ids))

    def closed(self, done: TargetDone) -> None:
        with self._lock:
            entry = self._open.pop(done.load_id, None)
        if entry is not None:
            request_id, dst = entry
            # A share that loaded says how many leading blocks it loaded (a peer share may be shorter).
            self.outcomes.add(request_id, done.ok, dst[done.blocks:] if done.ok else dst)


class RankLoop:
    """Rank > 0: take ``target_load`` off the link, start it, poll the READs, report (see the module docstring)."""

    def __init__(self, *, rank: int, link: MessageLink, config: TargetConfig, book: ShareBook,
                 stop: threading.Event) -> None:
        self.rank = rank
        self._link = link
        self._config = config
        self._book = book
        self._stop = stop
        self._mux = RpcMux(timeout_ms=float(config.rpc_timeout_ms), curve=config.source_curve)
        self._worker: RankWorker | None = None
        self._peers: PeerShares | None = None

    def attach(self, worker: RankWorker) -> None:
        """The rank's worker (it reports through :meth:`report`); before :meth:`run`."""
        self._worker = worker
        self._peers = PeerShares(rank=self.rank, worker=worker, mux=self._mux, report=self.report,
                                 ttl_ms=self._config.lease_ttl_ms)

    def report(self, done: TargetDone) -> None:
        """A share ended: tell the leader (a report that cannot go out is timed out by the leader) and the engine."""
        if self._peers is not None:
            done = self._peers.vouch(done)  # a share that may have lapsed mid-READ is no success
        # This rank's engine hears first: once the leader reports the request, every rank's share outcome
        # is already there to be taken (a few microseconds before the leader's report).
        self._book.closed(done)
        try:
            self._link.send(done)
        except (LinkClosed, ProtocolError) as e:
            log.warning("target rank %d: could not report load %d: %s", self.rank, done.load_id, e)
        if self._peers is not None:
            self._peers.reported(done)  # after the report: the release is off the load's path

    def run(self) -> None:
        worker, peers, mux, link = self._worker, self._peers, self._mux, self._link
        assert worker is not None and peers is not None
        gone: list[bool] = []

        def on_link() -> None:
            try:
                loads = link.receive()
            except (LinkClosed, ProtocolError) as e:  # the leader is gone: nobody to report to
                if not self._stop.is_set():
                    log.warning("target rank %d: link to the leader lost (%s); stopping", self.rank, e)
                gone.append(True)
                return
            now = time.monotonic()
            for load in loads:
                if not isinstance(load, TargetLoad):
                    log.warning("target rank %d: ignoring %s from the leader", self.rank, type(load).__name__)
                    continue
                self._book.opened(load)
                if load.peer is not None:
                    peers.start(load, now)
                else:
                    worker.start(load, now)

        mux.watch(link.fileno(), on_link)
        try:
            while not self._stop.is_set() and not gone:
                due = peers.next_due()
                wait_ms = 100 if due is None else min(100, max(1, math.ceil((due - time.monotonic()) * 1000.0)))
                mux.run_once(0 if worker.busy else wait_ms)
                peers.tick(time.monotonic())
                if worker.busy:
                    worker.poll()
                worker.release_retired()  # after the reports went out
                if worker.busy:
                    time.sleep(POLL_S)
        except Exception:  # pragma: no cover - a bug; the leader times the loads out
            log.exception("target rank %d: serving loop failed", self.rank)
        finally:
            worker.close()  # fails (and reports) whatever is still in flight
            link.close()
            deadline = time.monotonic() + 0.5
            while mux.pending() and time.monotonic() < deadline:  # let the shares' releases go out
                mux.run_once(20)
            mux.close()


class ShareLoop:
    """The leader's own share: take ``target_load`` off the queue, start it, poll the READs; report by event.

    ``report`` hands each outcome to the coordinator; the queue's ``None`` stops the loop.
    """

    def __init__(self, *, shares: queue.SimpleQueue[TargetLoad | None], book: ShareBook,
                 report: Callable[[TargetDone], None]) -> None:
        self._shares = shares
        self._book = book
        self._to_coordinator = report
        self._worker: RankWorker | None = None

    def attach(self, worker: RankWorker) -> None:
        self._worker = worker

    def report(self, done: TargetDone) -> None:
        self._book.closed(done)  # first, as on the other ranks (RankLoop.report)
        self._to_coordinator(done)

    def run(self) -> None:
        worker = self._worker
        assert worker is not None
        try:
            while True:
                try:
                    if worker.busy:  # READs to poll: only what is already queued
                        load = self._shares.get_nowait()
                    elif worker.retired:  # sleep a moment first: the coordinator takes the report meanwhile
                        load = self._shares.get(timeout=RELEASE_AFTER_MS / 1000.0)
                    else:
                        load = self._shares.get()
                except queue.Empty:
                    worker.release_retired()
                    if worker.busy:
                        worker.poll()
                        if worker.busy:
                            time.sleep(POLL_S)
                    continue
                if load is None:
                    return
                self._book.opened(load)
                worker.start(load, time.monotonic())  # checks (and reports) it once right away
        except Exception:  # pragma: no cover - a bug; the coordinator times the loads out
            log.exception("target leader: its share loop failed")
        finally:
            worker.close()  # fails (and reports) whatever is still in flight
