"""The target client: one per TP rank of a worker that reuses blocks other workers hold in G2.

Engine-facing contract (rank 0 is the *leader*: the rank the engine's
scheduler talks to; every rank must create its client)::

    client = maybe_start_target_client(pool, tp_rank=r, tp_size=n, worker_id="w1", config=cfg)
    m = client.lookup(block_hashes)            # leader: how many leading blocks a remote source has
    client.start_load(req_id, block_hashes[:m.matched], dst_block_ids)   # leader; returns at once
    done, failed = client.get_finished()       # leader, every engine step; never blocks
    bad = client.invalid_block_ids()           # destination blocks to recompute (drained on read)
    client.finished_fd() / client.wait_finished(timeout_s)   # leader: wake when a load ends, not poll
    client.shutdown()                          # every rank

How a load runs. The leader's coordinator is one thread running an event loop
(:class:`~remote_g2.rpc_mux.RpcMux`): no step of one load blocks another, so
many loads — to many sources — are in flight at once. For each load it
resolves a lease on the source (``resolve``: every source rank pins the
prefix), sends every other target rank its ``target_load`` *first*, then
hands its own share to the leader's share thread, which drives the leader's
:class:`~.rank_worker.RankWorker` like every other rank's loop drives its
own. Each rank plans and issues its own READs and answers ``target_done``.
The leader waits for **every** rank, so no rank still writes into a
destination block when the engine hears the outcome.

Why the leader's READs have a thread of their own: on one host NIXL copies
the bytes inside the post (UCX ``cma``), 32 MiB taking ~9 ms here. Posted
from the coordinator, they held up everything else it does for that long —
with several loads in flight, the next load's ``target_load`` waited while
the other ranks sat idle. NIXL lets go of the GIL while it copies, so the
coordinator keeps resolving and dispatching meanwhile.

The ranks talk over :mod:`~remote_g2.local_link` links (one Unix stream
socket per rank to the leader, set up at start-up), not ZMQ: one thread to
wake per hop instead of three, and a rank that is gone — its client shut
down, its process died — closes its end, so the leader fails the loads it
owed at once and every later load without waiting for a timeout.

Then the lease. When every rank finished before the lease could have expired
on the source (its expiry, counted conservatively from when the resolve was
*sent*), the pins held for the whole READ, so the load is reported done at
once and the release goes out without being waited for. Otherwise the
release's answer decides: a lease already gone fails the load, because the
pins may have lapsed mid-READ. Leases are renewed when a load outlives half
its TTL, and released after success and after failure.

Outcomes: a request is *done* when every rank read every byte of the prefix
the source pinned; destination blocks past that prefix (the source held
fewer than the registry said) are listed by :meth:`TargetClient.invalid_block_ids`.
A request is *failed* — and all its destination blocks are invalid — when
lookup or resolve found nothing, the source answered ERR or did not answer
within ``rpc_timeout_ms``, any rank's READ ended in error or outlived
``transfer_timeout_ms``, a rank never answered, or the lease was lost.

Time bounds: each RPC step before the READs (lookup when the scheduler's
answer is not cached, resolve, metadata) is bounded by ``rpc_timeout_ms``; the
READs by ``transfer_timeout_ms`` from the moment the leader hands them out —
the ranks' deadline, after which no rank posts a READ (see
:mod:`.rank_worker`). The leader reports a rank that never answered one
``rpc_timeout_ms`` after that deadline.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import secrets
import select
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remote_g2.adapters.registry import load_adapter
from remote_g2.adapters.secondary_pool import SecondaryPool

from remote_g2.errors import (
    ConfigError,
    ProtocolError,
    RemoteG2Error,
    RpcClosed,
    RpcTimeout,
    TransferError,
    TransportError,
)
from remote_g2.ipc_paths import ipc_endpoint, prepare_ipc_dir
from remote_g2.local_link import LinkClosed, LinkListener, MessageLink, connect_link
from remote_g2.log import cpu_set_text
from remote_g2.messages import (
    GetMetadata,
    Lookup,
    LookupReply,
    PeerResolve,
    RankBlocks,
    RankInfo,
    Release,
    Renew,
    Resolve,
    ResolveReply,
    TargetDone,
    TargetLoad,
)
from remote_g2.rpc_mux import RpcMux
from remote_g2.stall_watchdog import maybe_start_stall_watchdog
from remote_g2.tp_group import TpGroup, resolve_tp_group

from .config import TargetConfig
from .metrics import TargetMetrics
from .peer_share import PeerShares
from .rank_worker import POLL_S, RankWorker
from .tp_mapping import check_fingerprints

__all__ = ["TargetClient", "TargetMatch", "maybe_start_target_client", "start_target_client"]

log = logging.getLogger("remote_g2.target")

_LOOKUP_CACHE = 4096  # recent lookups kept so start_load reuses the scheduler's answer
# After a load is reported done, its lease's release waits this long, so that the engine's thread (woken by
# the report) gets the GIL — and on a busy or bound host the CPU, which the source rank answering the release
# may share — first; the leader's share thread waits as long before it frees its finished READs' handles.
_RELEASE_AFTER_MS = 1.0


@dataclass(frozen=True)
class TargetMatch:
    """What :meth:`TargetClient.lookup` found: ``matched`` leading blocks on ``worker_id``, or why not."""

    matched: int
    reason: str
    worker_id: str | None = None
    endpoint: str | None = None
    tp_size: int | None = None


def maybe_start_target_client(pool: SecondaryPool, *, tp_rank: int | None = None, tp_size: int | None = None,
                              worker_id: str, config: TargetConfig | None = None,
                              comm: Any = None) -> TargetClient | None:
    """This rank's target client when enabled (``config.enabled`` or ``REMOTE_G2_TARGET=1``), else None.

    ``pool`` is the rank's destination memory (its ``layout`` property and
    ``regions()``; block ``b`` at ``regions()[0].base + b * block_bytes``).
    Collective over the TP group (``comm``; default MPI world split by
    ``tp_size``) at start-up, as the source service is: call it on every rank.
    """
    config = TargetConfig.from_env() if config is None else config.with_env_enable()
    if not config.enabled:
        log.debug("target client disabled (set REMOTE_G2_TARGET=1 or TargetConfig.enabled)")
        return None
    return start_target_client(pool, tp_rank=tp_rank, tp_size=tp_size, worker_id=worker_id, config=config,
                               comm=comm)


def start_target_client(pool: SecondaryPool, *, tp_rank: int | None = None, tp_size: int | None = None,
                        worker_id: str, config: TargetConfig, comm: Any = None) -> TargetClient:
    """Start unconditionally (see :func:`maybe_start_target_client`)."""
    if not worker_id or len(worker_id) > 128:
        raise ConfigError(f"worker_id must be 1..128 characters, got {worker_id!r}")
    group = resolve_tp_group(tp_rank, tp_size, comm)
    client = TargetClient(pool, worker_id=worker_id, group=group, config=config)
    try:
        client._start()
    except BaseException:
        client.shutdown()
        raise
    return client


@dataclass
class _Load:
    """The leader's view of one request's load."""

    load_id: int
    request_id: str
    hashes: list[bytes]
    dst: list[int]
    match: TargetMatch | None = None
    lease_id: int = 0
    lease_endpoint: str | None = None  # where the lease was taken: renew and release go there (its owner)
    lease_expires: float = 0.0      # monotonic; conservative (counted from the resolve's send time)
    waiting: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    invalid_tail: list[int] = field(default_factory=list)
    deadline: float = 0.0           # the ranks': no READ starts after it
    report_by: float = 0.0          # the leader's: ranks still silent then are given up
    renew_at: float = 0.0
    renewing: bool = False
    started: float = field(default_factory=time.monotonic)
    dispatched: float = 0.0         # when every rank was handed its share (for the "reads" phase)
    peer: bool = False              # every rank resolves its own share (peer_resolve) under lease_id
    peer_epoch: int = 0             # the source epoch a peer load expects
    loaded: dict[int, int] = field(default_factory=dict)  # rank -> leading blocks it loaded (peer loads)
    retry: bool = False             # a peer load that found the source restarted: resolve it again, classically


def _lane_gone(error: Exception) -> bool:
    """A call failed because its connection was refused or dropped (not a timeout, not our own shutdown)."""
    return isinstance(error, TransportError) and not isinstance(error, (RpcTimeout, RpcClosed))


def _drain(fd: int) -> None:
    """Read a non-blocking wake-up pipe empty (nothing to do for -1: not open, or closed)."""
    if fd < 0:
        return
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass


def _boot_id() -> str:
    """Identifies this host's monotonic clock (it is shared by every process of one boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return f"pid-{os.getpid()}"  # unknown: no other process is assumed to share it


class TargetClient:
    """One rank's client; see the module docstring. Build with :func:`start_target_client`."""

    def __init__(self, pool: SecondaryPool, *, worker_id: str, group: TpGroup, config: TargetConfig) -> None:
        self.worker_id = worker_id
        self.rank, self.tp_size = group.rank, group.size
        self.config = config
        self._group = group
        self._pool = pool
        self._worker: RankWorker | None = None
        self._share: threading.Thread | None = None  # leader: drives its own RankWorker
        self._shares: queue.SimpleQueue[TargetLoad | None] = queue.SimpleQueue()  # leader: its own share, or stop
        self._closed = False
        self._loop: threading.Thread | None = None  # rank > 0: takes target_load off its link, drives the worker
        self._link: MessageLink | None = None       # rank > 0: to the leader
        self._peer_shares: PeerShares | None = None  # rank > 0: shares it resolves with its peer source rank
        # leader: to every other rank; a rank whose link dropped is gone for good (its loads fail at once)
        self._listener: LinkListener | None = None
        self._links: dict[int, MessageLink] = {}
        self._link_fds: dict[int, int] = {}  # rank -> the fd its link is watched under, while it is up
        # leader only
        self._registry: Any = None            # RegistryClient for the scheduler's synchronous lookups
        self._mirror: Any = None              # RegistryMirror answering them from memory, when configured
        self._mux: RpcMux | None = None       # owned by the coordinator thread
        self._source_infos: dict[str, tuple[int, dict[int, RankInfo], set[str]]] = {}  # wid -> epoch, infos, sent
        self._source_endpoints: dict[str, str | None] = {}  # wid -> the endpoint its infos came from
        self._peer_off: set[tuple[str, int]] = set()  # (source, epoch) whose peer resolve failed: rank 0 resolves
        self._lookups: OrderedDict[tuple[bytes, ...], TargetMatch] = OrderedDict()
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = -1, -1
        self._finished_r, self._finished_w = -1, -1  # leader: readable while get_finished has news
        self._loads: dict[int, _Load] = {}
        self._releases: list[tuple[float, _Load]] = []  # (when due, load): done loads whose release waits
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._invalid: set[int] = set()
        self._stop = threading.Event()
        self.stats = {"loads": 0, "done": 0, "failed": 0, "bytes": 0, "descriptors": 0, "mirror_lookups": 0,
                      "peer_loads": 0}
        self.metrics = TargetMetrics()

    # -- start-up ------------------------------------------------------------------------

    def _start(self) -> None:
        error: str | None = None
        maybe_start_stall_watchdog()  # REMOTE_G2_STALL_DUMP_S: stacks to stderr when Python stalls
        path = ""
        clock = _boot_id()
        transfer = None
        try:
            layout = self._pool.layout
            regions = self._pool.regions()
            transfer = load_adapter("transfer", self.config.transfer)(
                f"remote-g2-target-{self.worker_id}-tp{self.rank}")
            transfer.register_local(regions)
            if self.rank == 0 and self.tp_size > 1:
                directory = prepare_ipc_dir(self.config.ipc_directory)
                path = ipc_endpoint(directory, f"target-{self.worker_id}", 0)[len("ipc://"):]
                self._listener = LinkListener(path)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        mine = {"path": path, "error": error, "clock": clock}
        try:
            gathered = self._gather(mine)
        except BaseException:
            if transfer is not None:
                transfer.close()
            raise
        assert transfer is not None
        # The leader's worker runs on its share thread and reports through the coordinator's events.
        report = (lambda done: self._post("done", done)) if self.rank == 0 else self._report_to_leader
        # Owned from here on: shutdown() closes the adapter even when the links below fail.
        self._worker = RankWorker(rank=self.rank, tp_size=self.tp_size, layout=layout, pool_base=regions[0].base,
                                  transfer=transfer, report=report,
                                  shares_leader_clock=gathered[0]["clock"] == clock)
        timeout = float(self.config.rpc_timeout_ms)
        # The links: every other rank connects to the leader's listener and says which rank it is.
        try:
            if self.rank == 0 and self._listener is not None:
                self._links = self._listener.accept_ranks(set(range(1, self.tp_size)), self.worker_id,
                                                          timeout_s=timeout / 1000.0)
            elif self.rank > 0:
                self._link = connect_link(gathered[0]["path"], rank=self.rank, worker_id=self.worker_id,
                                          timeout_s=timeout / 1000.0)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        self._gather({"error": error})
        if self.rank == 0:
            self._mux = RpcMux(timeout_ms=timeout, curve=self.config.source_curve)
            if self.config.metrics_port is not None:
                self.metrics.serve_http(self.config.metrics_port, self.config.metrics_addr)
            if self.config.registry_endpoint:
                from remote_g2.registry import RegistryClient

                self._registry = RegistryClient(self.config.registry_endpoint, timeout_s=timeout / 1000.0,
                                                curve=self.config.registry_curve)
                if self.config.registry_mirror:
                    from remote_g2.registry import RegistryMirror

                    self._mirror = RegistryMirror(self.config.registry_endpoint, timeout_s=timeout / 1000.0,
                                                  curve=self.config.registry_curve).start()
            self._wake_r, self._wake_w = os.pipe()
            self._finished_r, self._finished_w = os.pipe()
            for fd in (self._wake_r, self._wake_w, self._finished_r, self._finished_w):
                os.set_blocking(fd, False)
            target, name = self._coordinate, f"remote-g2-target-{self.worker_id}"
            self._share = threading.Thread(target=self._serve_share, name=f"{name}-tp0", daemon=True)
            self._share.start()
        else:
            target, name = self._serve_rank, f"remote-g2-target-{self.worker_id}-tp{self.rank}"
        self._loop = threading.Thread(target=target, name=name, daemon=True)
        self._loop.start()
        log.info("target client %s rank %d/%d up (%s; threads on CPUs %s)", self.worker_id, self.rank, self.tp_size,
                 self.config.transfer, cpu_set_text())

    def _gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's ``mine``; raises on every rank when any rank reported an error."""
        gathered = [mine] if self._group.comm is None else self._group.comm.allgather(mine)
        failed = [f"rank {i}: {g['error']}" for i, g in enumerate(gathered) if g["error"]]
        if failed:
            raise TransferError("target client start-up failed on TP rank(s): " + "; ".join(failed))
        return gathered

    # -- engine-facing (leader) --------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> TargetMatch:
        """How many leading blocks of ``block_hashes`` one remote source can give, from whom, or why not.

        Synchronous: one registry round trip, or none when the config keeps a
        registry mirror and its copy is complete (the server answers while it
        is not). Answers ``no_registry`` without a registry and never raises
        for a registry that is down (``registry_error``).
        The answer is remembered, so a :meth:`start_load` of the matched
        prefix goes straight to the resolve.
        """
        self._leader_only("lookup")
        if not block_hashes:
            return TargetMatch(0, "no_candidate")
        if self._registry is None:
            return TargetMatch(0, "no_registry")
        request = Lookup(list(block_hashes), self.worker_id, self._compat_key())
        try:
            # Without a complete copy (still syncing, or retaking it) the server answers.
            replies = self._mirror.lookup_many([request]) if self._mirror is not None else None
            if replies is not None:
                reply = replies[0]
                self.metrics.mirror_lookups.inc()
                self.stats["mirror_lookups"] += 1
            else:
                reply = self._registry.lookup(request.hashes, requester=request.requester,
                                              compat_key=request.compat_key)
        except RemoteG2Error as e:
            log.warning("lookup failed: %s", e)
            self.metrics.lookup("registry_error", 0)
            return TargetMatch(0, "registry_error")
        match = self._match_from(reply)
        self.metrics.lookup(match.reason, match.matched)
        with self._lock:
            self._lookups[tuple(block_hashes[:match.matched])] = match
            while len(self._lookups) > _LOOKUP_CACHE:
                self._lookups.popitem(last=False)
        return match

    def wait_registry_mirror(self, timeout_s: float) -> bool:
        """True once the registry mirror (``config.registry_mirror``) holds a complete copy; False without
        one, or when ``timeout_s`` passed first. Lookups work either way (the server answers meanwhile)."""
        self._leader_only("wait_registry_mirror")
        return self._mirror is not None and bool(self._mirror.wait_ready(timeout_s))

    def start_load(self, request_id: str, block_hashes: Sequence[bytes], dst_block_ids: Sequence[int]) -> None:
        """Load the blocks of ``block_hashes`` into ``dst_block_ids`` (same length), asynchronously.

        The outcome arrives through :meth:`get_finished`. Uses the source the
        last :meth:`lookup` of these hashes chose (or looks up again).
        """
        self._leader_only("start_load")
        if len(block_hashes) != len(dst_block_ids) or not block_hashes:
            raise ValueError(f"start_load({request_id!r}): {len(block_hashes)} hashes for "
                             f"{len(dst_block_ids)} destination blocks")
        self._post("start", (request_id, list(block_hashes), [int(b) for b in dst_block_ids]))

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose load finished since the last call: ``(done, failed)``. Never blocks."""
        with self._lock:  # under the lock, as in _report: the fd is readable exactly while outcomes wait
            _drain(self._finished_r)
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

    def finished_fd(self) -> int:
        """A file descriptor (leader) that is readable while :meth:`get_finished` has outcomes to hand out.

        For engines with an event loop (``loop.add_reader(fd, ...)``, ``select``)
        that would rather wake when a load ends than poll every step;
        :meth:`get_finished` makes it unreadable again. Owned by the client:
        do not read or close it, and stop watching it before :meth:`shutdown`.
        """
        self._leader_only("finished_fd")
        return self._finished_r

    def wait_finished(self, timeout_s: float) -> bool:
        """Block (leader) until :meth:`get_finished` has outcomes, at most ``timeout_s``; True if it has.

        Costs no CPU while it waits, unlike a polling loop, which on a small
        host takes the CPU the READs copy with (docs/target.md).
        """
        self._leader_only("wait_finished")
        readable, _, _ = select.select([self._finished_r], [], [], max(0.0, timeout_s))
        return bool(readable)

    def invalid_block_ids(self) -> set[int]:
        """Destination blocks whose load failed since the last call (the engine recomputes them)."""
        with self._lock:
            out, self._invalid = self._invalid, set()
        return out

    def shutdown(self) -> None:
        """Stop this rank's client; loads still running fail (their leases are released). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._loop is not None:
            if self.rank == 0:
                self._post("stop", None)
            self._loop.join(10)
        else:  # start-up failed before the loop owned them
            if self._worker is not None:
                self._worker.close()
            if self._mux is not None:
                self._mux.close()
        for link in [self._link, *self._links.values()]:
            if link is not None:
                link.close()
        if self._listener is not None:
            self._listener.close()
        if self._mirror is not None:
            self._mirror.close()
        if self._registry is not None:
            self._registry.close()
        self.metrics.close()
        for fd in (self._wake_r, self._wake_w, self._finished_r, self._finished_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = self._finished_r = self._finished_w = -1

    def _leader_only(self, what: str) -> None:
        if self.rank != 0:
            raise ConfigError(f"{what} is called on target rank 0 (the leader), not rank {self.rank}")
        if self._closed:
            raise ConfigError(f"{what}: the target client is shut down")

    def _compat_key(self) -> str | None:
        fp = self.config.fingerprint
        return fp.compat_key() if fp else None

    def _match_from(self, reply: LookupReply) -> TargetMatch:
        if reply.reason != "ok" or reply.best is None:
            return TargetMatch(0, reply.reason)
        best, fp = reply.best, self.config.fingerprint
        reason = check_fingerprints(replace(fp, tp_size=best.tp_size), fp) if fp else None
        if reason:
            return TargetMatch(0, f"incompatible_layout: {reason}", best.worker_id, best.endpoint, best.tp_size)
        return TargetMatch(reply.matched, "ok", best.worker_id, best.endpoint, best.tp_size)

    # -- rank > 0 ----------------------------------------------------------------------------

    def _serve_rank(self) -> None:
        """Rank > 0's loop: take ``target_load`` off the link, start it, poll the READs, report.

        An event loop (:class:`~remote_g2.rpc_mux.RpcMux`) watching the link,
        so that a share resolved with this rank's peer source rank
        (:class:`~.peer_share.PeerShares`) waits for its answer without
        holding up anything else.
        """
        link, worker = self._link, self._worker
        assert link is not None and worker is not None
        mux = RpcMux(timeout_ms=float(self.config.rpc_timeout_ms), curve=self.config.source_curve)
        peers = PeerShares(rank=self.rank, worker=worker, mux=mux,
                           report=self._report_to_leader, ttl_ms=self.config.lease_ttl_ms)
        self._peer_shares = peers
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
                elif load.peer is not None:
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

    def _serve_share(self) -> None:
        """The leader's own share: take ``target_load`` off the queue, start it, poll the READs; report by event."""
        worker = self._worker
        assert worker is not None
        try:
            while True:
                try:
                    if worker.busy:  # READs to poll: only what is already queued
                        load = self._shares.get_nowait()
                    elif worker.retired:  # sleep a moment first: the coordinator takes the report meanwhile
                        load = self._shares.get(timeout=_RELEASE_AFTER_MS / 1000.0)
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
                worker.start(load, time.monotonic())  # checks (and reports) it once right away
        except Exception:  # pragma: no cover - a bug; the coordinator times the loads out
            log.exception("target leader: its share loop failed")
        finally:
            worker.close()  # fails (and reports) whatever is still in flight

    def _report_to_leader(self, done: TargetDone) -> None:
        # On this rank's loop thread. A report that cannot go out is timed out by the leader.
        assert self._link is not None
        if self._peer_shares is not None:
            done = self._peer_shares.vouch(done)  # a share that may have lapsed mid-READ is no success
        try:
            self._link.send(done)
        except (LinkClosed, ProtocolError) as e:
            log.warning("target rank %d: could not report load %d: %s", self.rank, done.load_id, e)
        if self._peer_shares is not None:
            self._peer_shares.reported(done)  # after the report: the release is off the load's path

    # -- the leader's coordinator: an event loop; every method below runs on its thread --------------

    def _post(self, kind: str, item: Any) -> None:
        """Hand the coordinator an event (any thread) and wake it."""
        self._events.put((kind, item))
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (it is awake anyway) or closed
            pass

    def _from_rank(self, rank: int) -> None:
        """Rank ``rank``'s link is readable: its reports, or its departure."""
        try:
            reports = self._links[rank].receive()
        except (LinkClosed, ProtocolError) as e:
            self._rank_gone(rank, e)
            return
        for done in reports:
            if isinstance(done, TargetDone) and done.rank == rank:
                self._rank_done(done)
            else:
                log.warning("target leader: ignoring %s from rank %d", type(done).__name__, rank)

    def _rank_gone(self, rank: int, why: Exception) -> None:
        """Rank ``rank``'s link is down: stop watching it and fail every load it owes.

        Later loads fail too, when their send finds the link closed. The fd is
        unwatched here, whichever side noticed (a receive or a send), so that a
        later socket reusing the number is never taken for this link.
        """
        self._links[rank].close()
        fd = self._link_fds.pop(rank, None)
        if fd is not None:
            assert self._mux is not None
            self._mux.unwatch(fd)
            log.error("target rank %d is gone (%s): its loads fail, and every later one", rank, why)
        for load in list(self._loads.values()):
            if rank in load.waiting:
                self._rank_done(TargetDone(load.load_id, rank, False, f"target rank {rank} is gone: {why}"[:4000]))

    def _coordinate(self) -> None:
        mux = self._mux
        assert mux is not None and self._share is not None
        stopping = False
        mux.watch(self._wake_r, lambda: None)  # the events are taken below, after every wake-up
        for rank, link in self._links.items():
            self._link_fds[rank] = link.fileno()
            mux.watch(self._link_fds[rank], lambda rank=rank: self._from_rank(rank))
        while not stopping:
            try:
                mux.run_once(self._until_next_clock_ms())
                self._send_releases(time.monotonic())
                stopping = self._take_events()
                self._check_clocks()
            except Exception:  # pragma: no cover - a bug must not stop every later load
                log.exception("target coordinator: an event loop step failed")
        self._shares.put(None)  # the share thread fails (and reports) what it still has, then ends
        self._share.join(10)
        self._take_events()  # those reports
        self._send_releases(float("inf"))
        for load in list(self._loads.values()):
            self._fail(load, "the target client shut down")
        deadline = time.monotonic() + min(1.0, self.config.rpc_timeout_ms / 1000.0)
        while mux.pending() and time.monotonic() < deadline:  # let the releases go out and be answered
            mux.run_once(20)
        mux.close()

    def _take_events(self) -> bool:
        _drain(self._wake_r)
        while True:
            try:
                kind, item = self._events.get_nowait()
            except queue.Empty:
                return False
            if kind == "stop":
                return True
            if kind == "start":
                self._begin(*item)
            elif kind == "done":
                self._rank_done(item)

    def _until_next_clock_ms(self) -> float:
        now = time.monotonic()
        waits = [100.0]
        clocks = [t for load in self._loads.values() for t in (load.report_by, load.renew_at) if t]
        if clocks:
            waits.append((min(clocks) - now) * 1000.0 + 0.5)  # past the clock, not just before it
        if self._releases:  # whole milliseconds: the poll's resolution (a shorter wait would spin)
            waits.append(math.ceil((self._releases[0][0] - now) * 1000.0))
        return max(0.0, min(waits))

    def _begin(self, request_id: str, hashes: list[bytes], dst: list[int]) -> None:
        load = _Load(next(self._ids), request_id, hashes, dst)
        self._loads[load.load_id] = load
        self.stats["loads"] += 1
        with self._lock:
            match = self._lookups.pop(tuple(hashes), None)
        if match is not None:
            self._resolve(load, match)
        elif self.config.registry_endpoint is None:
            self._fail(load, "lookup: no_registry")
        else:
            assert self._mux is not None
            self._mux.call(self.config.registry_endpoint,
                           Lookup(hashes, self.worker_id, self._compat_key(), False),
                           lambda reply: self._looked_up(load, reply))

    def _looked_up(self, load: _Load, reply: Any) -> None:
        if load.load_id not in self._loads:
            return
        if isinstance(reply, Exception):
            self._fail(load, f"lookup: registry_error: {type(reply).__name__}: {reply}")
        else:
            self._resolve(load, self._match_from(reply))

    def _resolve(self, load: _Load, match: TargetMatch) -> None:
        if match.reason != "ok" or match.endpoint is None or match.worker_id is None:
            self._fail(load, f"lookup: {match.reason}")
            return
        load.match = match
        n = min(match.matched, len(load.hashes))
        if self._peer_ready(match.worker_id, match.endpoint):
            self._peer_resolve(load, match, n)
            return
        entry = self._source_infos.get(match.worker_id)
        known = sorted(entry[2]) if entry else []
        sent = time.monotonic()
        self.metrics.phase("to_resolve", sent - load.started)
        assert self._mux is not None
        load.lease_endpoint = match.endpoint
        self._mux.call(match.endpoint, Resolve(load.hashes[:n], self.config.lease_ttl_ms, self.worker_id, known),
                       lambda reply: self._resolved(load, reply, sent))

    def _resolved(self, load: _Load, reply: Any, sent: float) -> None:
        assert load.match is not None
        wid = load.match.worker_id
        self.metrics.phase("resolve", time.monotonic() - sent)
        if isinstance(reply, Exception):
            self._fail(load, f"resolve on {wid}: {type(reply).__name__}: {reply}")
            return
        load.lease_id = reply.lease_id
        if load.load_id not in self._loads:  # given up meanwhile (shut down): hand the lease back
            self._send_release(load)
            return
        if reply.reason != "ok" or reply.matched == 0:
            self._fail(load, f"resolve on {wid}: {reply.reason}")
            return
        load.lease_expires = sent + reply.expires_in_ms / 1000.0
        load.renew_at = sent + reply.expires_in_ms / 2000.0
        m = reply.matched
        load.invalid_tail, load.dst = load.dst[m:], load.dst[:m]
        infos, missing = self._source_ranks(wid, reply.epoch, reply.metadata)
        self._source_endpoints[wid] = load.match.endpoint
        if not missing:
            self._dispatch(load, reply, infos)
            return
        assert self._mux is not None and load.match.endpoint is not None

        def on_metadata(full: Any) -> None:
            if load.load_id not in self._loads:
                return
            if isinstance(full, Exception):
                self._fail(load, f"get_metadata on {wid}: {type(full).__name__}: {full}")
                return
            self._dispatch(load, reply, self._source_ranks(wid, reply.epoch, full.ranks)[0])

        self._mux.call(load.match.endpoint, GetMetadata(), on_metadata)

    def _source_ranks(self, worker: str, epoch: int, metadata: list[RankInfo]) -> tuple[dict[int, RankInfo], bool]:
        """Every known source rank's info for this epoch; True when an agent's metadata is still missing."""
        entry = self._source_infos.get(worker)
        if entry is None or entry[0] != epoch:
            entry = (epoch, {}, set())
            self._source_infos[worker] = entry
        _, infos, sent = entry
        for info in metadata:
            if info.agent_metadata is not None or info.rank not in infos:
                infos[info.rank] = info
        missing = not infos or any(i.agent_metadata is None and i.agent_name not in sent for i in infos.values())
        return infos, missing

    def _peer_ready(self, worker: str, endpoint: str) -> bool:
        """Whether every rank can resolve its own share of a load from ``worker`` (docs/target.md, "Peer resolve").

        Needs the same TP size, a dense model, a peer endpoint on every source
        rank > 0, and the source's current metadata on every target rank
        (sent with an earlier load, from the same endpoint: a new one is a
        restart); not after a peer call to that source epoch failed.
        """
        entry = self._source_infos.get(worker)
        if not self.config.peer_resolve or entry is None or (worker, entry[0]) in self._peer_off \
                or self._source_endpoints.get(worker) != endpoint:
            return False
        _, infos, sent = entry
        if len(infos) != self.tp_size or (self.config.fingerprint is not None and self.config.fingerprint.is_mla):
            return False
        return all(r in infos and (r == 0 or infos[r].peer_endpoint) and infos[r].agent_name in sent
                   for r in range(self.tp_size))

    def _peer_resolve(self, load: _Load, match: TargetMatch, n: int) -> None:
        """Hand every other rank its peer share first, then ask source rank 0 for the leader's own."""
        assert match.worker_id is not None and match.endpoint is not None and self._mux is not None
        wid = match.worker_id
        epoch, infos, _ = self._source_infos[wid]
        load.peer, load.peer_epoch = True, epoch
        self.stats["peer_loads"] += 1
        load.lease_id = secrets.randbits(62) + 1  # random: another reader's ids are not guessable
        load.invalid_tail, load.dst = load.dst[n:], load.dst[:n]
        hashes = load.hashes[:n]
        ask = PeerResolve(load.lease_id, hashes, self.config.lease_ttl_ms, self.worker_id)  # every rank's, alike
        msg = TargetLoad(load.load_id, wid, epoch, len(infos), False, 0, [], [], load.dst,
                         self.config.transfer_timeout_ms, self._start_clocks(load), ask)
        self._send_to_ranks(load, msg)
        sent = time.monotonic()
        self.metrics.phase("to_resolve", sent - load.started)
        # Source rank 0's stream lane when it has one (no ZMQ I/O threads on the way), else its worker endpoint.
        load.lease_endpoint = infos[0].peer_endpoint or match.endpoint
        self._mux.call(load.lease_endpoint, ask, lambda reply: self._peer_resolved(load, reply, sent, msg))

    def _peer_resolved(self, load: _Load, reply: Any, sent: float, msg: TargetLoad) -> None:
        """Rank 0's share is resolved (or not): start it, or count rank 0 as failed (the others still report)."""
        assert load.match is not None and load.match.worker_id is not None
        wid = load.match.worker_id
        self.metrics.phase("resolve", time.monotonic() - sent)
        if load.load_id not in self._loads:
            return  # given up meanwhile (shut down); _fail released the lease
        where = f"peer_resolve on {wid} rank 0"
        if isinstance(reply, Exception):
            why = f"{where}: {type(reply).__name__}: {reply}"
            self._peer_failed(wid, load.peer_epoch, why)
            if _lane_gone(reply) and load.lease_endpoint != load.match.endpoint:
                # Rank 0's lane refused or dropped the connection: its process is gone — perhaps restarted
                # behind the same worker endpoint (a fixed port), with new lanes. Resolve once more there,
                # classically, as for a new epoch; a source that is really gone fails that resolve.
                self._source_infos.pop(wid, None)
                load.retry = True
            self._rank_done(TargetDone(load.load_id, 0, False, why[:4000]))
            return
        if reply.epoch != load.peer_epoch:
            # Restarted: once every rank has answered (the others fail their shares the same way), this load
            # is resolved again through rank 0, which brings the new epoch's metadata.
            self._source_infos.pop(wid, None)
            load.retry = True
            self._send_release(load)
            self._rank_done(TargetDone(load.load_id, 0, False, f"{where}: the source restarted"))
            return
        if reply.reason != "ok" or reply.matched == 0:
            self._rank_done(TargetDone(load.load_id, 0, False, f"{where}: {reply.reason}"))
            return
        load.lease_expires = sent + reply.expires_in_ms / 1000.0
        load.renew_at = sent + reply.expires_in_ms / 2000.0
        self._shares.put(replace(msg, ranks=[RankBlocks(0, reply.block_ids)],
                                 dst_block_ids=load.dst[:reply.matched], peer=None))

    def _peer_failed(self, worker: str, epoch: int, why: str) -> None:
        if (worker, epoch) not in self._peer_off:
            self._peer_off.add((worker, epoch))
            log.warning("target: peer resolve with %s failed (%s); its loads go through rank 0's resolve from now "
                        "on (until it restarts)", worker, why)

    def _start_clocks(self, load: _Load) -> int:
        """Every rank is about to get its share: start the load's clocks; the ranks' deadline (monotonic ns)."""
        now = time.monotonic_ns()
        deadline_ns = now + self.config.transfer_timeout_ms * 1_000_000
        load.dispatched = now / 1e9
        load.deadline = deadline_ns / 1e9
        load.report_by = load.deadline + self.config.rpc_timeout_ms / 1000.0
        load.waiting = set(range(self.tp_size))
        return deadline_ns

    def _send_to_ranks(self, load: _Load, msg: TargetLoad) -> None:
        """Send every rank > 0 its ``target_load`` (no waiting for acks); a rank it cannot reach fails its share."""
        for r in range(1, self.tp_size):
            try:
                self._links[r].send(msg)
            except LinkClosed as e:
                self._rank_gone(r, e)
            except ProtocolError as e:  # this message cannot be sent (too large); the link is fine
                self._rank_done(TargetDone(load.load_id, r, False, f"target_load to rank {r}: {e}"[:4000]))

    def _dispatch(self, load: _Load, reply: ResolveReply, infos: dict[int, RankInfo]) -> None:
        """Hand every rank its share: the other ranks first (no waiting for acks), then this rank's worker."""
        assert load.match is not None and load.match.worker_id is not None and self._mux is not None
        sent = self._source_infos[load.match.worker_id][2]
        first_time = {info.agent_name for info in infos.values() if info.agent_name not in sent}
        sent.update(first_time)
        mla_offset = zlib.crc32(self.worker_id.encode()) % max(1, len(infos))
        is_mla = bool(self.config.fingerprint and self.config.fingerprint.is_mla)
        # Ranks keep what they were sent per (source worker, epoch): only agents new to them travel.
        msg = TargetLoad(load.load_id, load.match.worker_id, reply.epoch, len(infos), is_mla, mla_offset,
                         reply.ranks, [info for _, info in sorted(infos.items()) if info.agent_name in first_time],
                         load.dst, self.config.transfer_timeout_ms, self._start_clocks(load))
        self._send_to_ranks(load, msg)
        self._shares.put(msg)  # the others' shares are on the wire already

    def _rank_done(self, done: TargetDone) -> None:
        load = self._loads.get(done.load_id)
        if load is None or done.rank not in load.waiting:
            return
        load.waiting.discard(done.rank)
        if done.ok:
            self.stats["bytes"] += done.nbytes
            self.stats["descriptors"] += done.descriptors
            load.loaded[done.rank] = done.blocks
        else:
            load.errors.append(f"rank {done.rank}: {done.error}")
            if done.peer_failed and load.match is not None and load.match.worker_id is not None:
                self._peer_failed(load.match.worker_id, load.peer_epoch, f"rank {done.rank}: {done.error}")
        if not load.waiting:
            self._complete(load)

    def _complete(self, load: _Load) -> None:
        """Every rank answered (or was given up on): report, and hand the lease back."""
        if load.retry and load.match is not None:
            log.info("load of %s: source %s restarted; resolving it again", load.request_id, load.match.worker_id)
            load.dst, load.invalid_tail = load.dst + load.invalid_tail, []
            load.retry, load.peer, load.lease_id = False, False, 0
            load.errors, load.loaded, load.renew_at, load.report_by = [], {}, 0.0, 0.0
            self._resolve(load, load.match)
            return
        if load.dispatched:
            self.metrics.phase("reads", time.monotonic() - load.dispatched)
        if load.peer and not load.errors:
            # Each rank loaded the prefix its own peer pinned: the request has the shortest of them.
            m = min(load.loaded.get(r, 0) for r in range(self.tp_size))
            load.invalid_tail, load.dst = load.dst[m:] + load.invalid_tail, load.dst[:m]
        if load.errors:
            self._fail(load, "; ".join(load.errors))
        elif time.monotonic() < load.lease_expires:
            # Every READ ended while the pins certainly held: the bytes are good whatever the release says.
            # The engine hears first; the release falls due _RELEASE_AFTER_MS later (_send_releases).
            self._succeed(load)
            self._releases.append((time.monotonic() + _RELEASE_AFTER_MS / 1000.0, load))
        else:
            self._loads.pop(load.load_id, None)
            assert self._mux is not None and load.lease_endpoint is not None

            def on_release(reply: Any) -> None:
                if isinstance(reply, Exception) or not reply.released:
                    self._report(load, "the lease expired on the source before the load finished", ok=False)
                else:
                    self._report(load, None, ok=True)

            self._mux.call(load.lease_endpoint, Release(load.lease_id), on_release)

    def _check_clocks(self) -> None:
        now = time.monotonic()
        for load in list(self._loads.values()):
            if load.report_by and now > load.report_by:
                load.errors.append(f"rank(s) {sorted(load.waiting)} did not answer in time")
                load.waiting.clear()
                self._complete(load)
            elif load.renew_at and now > load.renew_at and not load.renewing:
                self._renew(load)

    def _renew(self, load: _Load) -> None:
        assert self._mux is not None and load.lease_endpoint is not None
        load.renewing = True
        sent = time.monotonic()

        def on_renewed(reply: Any) -> None:
            load.renewing = False
            if isinstance(reply, Exception):
                log.warning("renewing lease %d of %s: %s", load.lease_id, load.request_id, reply)
                load.renew_at = time.monotonic() + self.config.rpc_timeout_ms / 1000.0  # try again
            elif not reply.renewed:
                load.errors.append("the source dropped the lease before the load finished")
                load.renew_at = 0.0
            else:
                load.lease_expires = sent + reply.expires_in_ms / 1000.0
                load.renew_at = sent + reply.expires_in_ms / 2000.0

        self._mux.call(load.lease_endpoint, Renew(load.lease_id, self.config.lease_ttl_ms), on_renewed)

    def _send_releases(self, now: float) -> None:
        """Send the releases due by ``now`` (queued in order, so they fall due in order).

        Due ``_RELEASE_AFTER_MS`` after the report, however the report was
        made: one made inside the loop's poll (a rank's link) used to have
        its release sent at once, in the same step, and the source rank that
        took it then ran on the CPU the engine's thread was waking on.
        """
        while self._releases and self._releases[0][0] <= now:
            self._send_release(self._releases.pop(0)[1])

    def _send_release(self, load: _Load) -> None:
        """Release the lease without waiting for the outcome (the source's expiry covers a lost release)."""
        if not load.lease_id or load.lease_endpoint is None or self._mux is None:
            return

        def on_release(reply: Any) -> None:
            if isinstance(reply, Exception):
                log.warning("releasing lease %d at %s: %s", load.lease_id, load.lease_endpoint, reply)

        self._mux.call(load.lease_endpoint, Release(load.lease_id), on_release)

    def _succeed(self, load: _Load) -> None:
        self._loads.pop(load.load_id, None)
        self._report(load, None, ok=True)

    def _fail(self, load: _Load, why: str) -> None:
        self._loads.pop(load.load_id, None)
        self._send_release(load)
        self._report(load, why, ok=False)

    def _report(self, load: _Load, error: str | None, *, ok: bool) -> None:
        # Counters and logs first: the fd write is the last thing before the coordinator can sleep, and
        # whoever wakes on it finds the counters already moved.
        self.stats["done" if ok else "failed"] += 1
        invalid = len(load.invalid_tail) + (0 if ok else len(load.dst))
        self.metrics.load(ok, time.monotonic() - load.started, len(load.dst) if ok else 0, invalid)
        if error:
            log.warning("load of %s failed after %.1f ms: %s", load.request_id,
                        (time.monotonic() - load.started) * 1e3, error)
        with self._lock:
            if ok:
                self._done.add(load.request_id)
                self._invalid.update(load.invalid_tail)
            else:
                self._failed.add(load.request_id)
                self._invalid.update(load.dst)
                self._invalid.update(load.invalid_tail)
            try:  # with the sets, under the lock: whoever wakes on the fd finds the outcome
                os.write(self._finished_w, b"\0")
            except (BlockingIOError, OSError):  # full (it is readable anyway) or closed at shutdown
                pass
