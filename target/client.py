"""The target client: one per TP rank of a worker that reuses blocks other workers hold in G2.

Engine-facing contract (rank 0 is the *leader*: the rank the engine's
scheduler talks to; every rank must create its client)::

    client = maybe_start_target_client(pool, tp_rank=r, tp_size=n, worker_id="w1", config=cfg)
    m = client.lookup(block_hashes)            # leader: how many leading blocks a remote source has
    client.start_load(req_id, block_hashes[:m.matched], dst_block_ids)   # leader; returns at once
    done, failed = client.get_finished()       # leader, every engine step; never blocks
    bad = client.invalid_block_ids()           # destination blocks to recompute (drained on read)
    client.shutdown()                          # every rank

How a load runs. The leader's coordinator thread resolves a lease on the
source (``resolve``: every source rank pins the prefix), then sends every
target rank its ``target_load`` over the worker's private IPC sockets (its own
share goes straight to its :class:`~.rank_worker.RankWorker`). Each rank plans
and issues its own READs and answers ``target_done``. The leader waits for
**every** rank — so no rank still writes into a destination block when the
engine hears the outcome — then releases the lease. A release that finds the
lease already gone (it expired on the source) fails the load: the pins may
have lapsed mid-READ, so the bytes are not trusted.

Outcomes: a request is *done* when every rank read every byte of the prefix
the source pinned; destination blocks past that prefix (the source held
fewer than the registry said) are listed by :meth:`TargetClient.invalid_block_ids`.
A request is *failed* — and all its destination blocks are invalid — when
lookup or resolve found nothing, the source answered ERR or did not answer
within ``rpc_timeout_ms``, any rank's READ ended in error or outlived
``transfer_timeout_ms``, a rank never answered, or the lease was lost.
Nothing waits past ``transfer_timeout_ms`` plus one RPC timeout. Leases are
renewed when a load outlives half its TTL, and released after success and
after failure.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from remote_g2.adapters.registry import load_adapter
from remote_g2.adapters.secondary_pool import SecondaryPool
from remote_g2.errors import ConfigError, RemoteG2Error, TransferError
from remote_g2.messages import (
    GetMetadata,
    RankInfo,
    Release,
    Renew,
    Resolve,
    TargetAck,
    TargetDone,
    TargetLoad,
)
from remote_g2.rpc_client import RpcClient
from remote_g2.rpc_server import CallContext, RpcServer
from remote_g2.source.siblings import claim_ipc_path, prepare_ipc_dir, release_ipc_path
from remote_g2.source.tp_group import TpGroup, resolve_tp_group

from .config import TargetConfig
from .rank_worker import RankWorker
from .tp_mapping import check_fingerprints

__all__ = ["TargetClient", "TargetMatch", "maybe_start_target_client", "start_target_client"]

log = logging.getLogger("remote_g2.target")

_LOOKUP_CACHE = 4096  # recent lookups kept so start_load reuses the scheduler's answer


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

    ``pool`` is the rank's destination memory (its ``layout()`` and
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
    dst: list[int]
    lease_id: int = 0
    source: RpcClient | None = None
    waiting: set[int] = field(default_factory=set)
    errors: list[str] = field(default_factory=list)
    invalid_tail: list[int] = field(default_factory=list)
    deadline: float = 0.0
    renew_at: float = 0.0
    started: float = field(default_factory=time.monotonic)


class TargetClient:
    """One rank's client; see the module docstring. Build with :func:`start_target_client`."""

    def __init__(self, pool: SecondaryPool, *, worker_id: str, group: TpGroup, config: TargetConfig) -> None:
        self.worker_id = worker_id
        self.rank, self.tp_size = group.rank, group.size
        self.config = config
        self._group = group
        self._pool = pool
        self._worker: RankWorker | None = None
        self._server: RpcServer | None = None
        self._endpoints: list[str] = []
        self._closed = False
        self._leader: RpcClient | None = None  # rank > 0: reports go to the leader through it
        # leader only
        self._ranks: dict[int, RpcClient] = {}
        self._registry: Any = None
        self._sources: dict[str, RpcClient] = {}
        self._source_infos: dict[str, tuple[int, dict[int, RankInfo], set[str]]] = {}  # wid -> epoch, infos, sent
        self._lookups: OrderedDict[tuple[bytes, ...], TargetMatch] = OrderedDict()
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._loads: dict[int, _Load] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._done: set[str] = set()
        self._failed: set[str] = set()
        self._invalid: set[int] = set()
        self._coordinator: threading.Thread | None = None
        self._stop = threading.Event()
        self.stats = {"loads": 0, "done": 0, "failed": 0, "bytes": 0, "descriptors": 0}

    # -- start-up ------------------------------------------------------------------------

    def _start(self) -> None:
        error: str | None = None
        endpoint = ""
        try:
            layout = self._pool.layout()
            regions = self._pool.regions()
            transfer = load_adapter("transfer", self.config.transfer)(
                f"remote-g2-target-{self.worker_id}-tp{self.rank}")
            transfer.register_local(regions)
            report = self._on_local_done if self.rank == 0 else self._report_to_leader
            self._worker = RankWorker(rank=self.rank, tp_size=self.tp_size, layout=layout,
                                      pool_base=regions[0].base, transfer=transfer, report=report)
            directory = prepare_ipc_dir(self.config.ipc_directory)
            endpoint = f"ipc://{directory}/target-{self.worker_id}_tp{self.rank}.sock"
            claim_ipc_path(endpoint)
            handlers = ({"target_done": self._target_done} if self.rank == 0 else {"target_load": self._target_load})
            self._server = RpcServer(endpoint, handlers, name=f"target-{self.worker_id}-tp{self.rank}", workers=1)
            self._server.start()
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
        gathered = [{"endpoint": endpoint, "error": error}] if self._group.comm is None else \
            self._group.comm.allgather({"endpoint": endpoint, "error": error})
        failed = [f"rank {i}: {g['error']}" for i, g in enumerate(gathered) if g["error"]]
        if failed:
            raise TransferError("target client start-up failed on TP rank(s): " + "; ".join(failed))
        self._endpoints = [g["endpoint"] for g in gathered]
        if self.rank == 0:
            timeout = float(self.config.rpc_timeout_ms)
            self._ranks = {r: RpcClient(ep, timeout_ms=timeout) for r, ep in enumerate(self._endpoints) if r}
            if self.config.registry_endpoint:
                from remote_g2.registry import RegistryClient

                self._registry = RegistryClient(self.config.registry_endpoint, timeout_s=timeout / 1000.0)
            self._coordinator = threading.Thread(target=self._coordinate, name=f"remote-g2-target-{self.worker_id}",
                                                 daemon=True)
            self._coordinator.start()
        log.info("target client %s rank %d/%d up (%s)", self.worker_id, self.rank, self.tp_size, self.config.transfer)

    # -- engine-facing (leader) --------------------------------------------------------------

    def lookup(self, block_hashes: Sequence[bytes]) -> TargetMatch:
        """How many leading blocks of ``block_hashes`` one remote source can give, from whom, or why not.

        Synchronous (one registry round trip); answers ``no_registry`` without
        one and never raises for a registry that is down (``registry_error``).
        """
        self._leader_only("lookup")
        if not block_hashes:
            return TargetMatch(0, "no_candidate")
        if self._registry is None:
            return TargetMatch(0, "no_registry")
        fp = self.config.fingerprint
        try:
            reply = self._registry.lookup(list(block_hashes), requester=self.worker_id,
                                          compat_key=fp.compat_key() if fp else None)
        except RemoteG2Error as e:
            log.warning("lookup failed: %s", e)
            return TargetMatch(0, "registry_error")
        if reply.reason != "ok" or reply.best is None:
            match = TargetMatch(0, reply.reason)
        else:
            best = reply.best
            reason = check_fingerprints(replace(fp, tp_size=best.tp_size), fp) if fp else None
            match = (TargetMatch(0, f"incompatible_layout: {reason}", best.worker_id, best.endpoint, best.tp_size)
                     if reason else TargetMatch(reply.matched, "ok", best.worker_id, best.endpoint, best.tp_size))
        with self._lock:
            self._lookups[tuple(block_hashes[:match.matched])] = match
            while len(self._lookups) > _LOOKUP_CACHE:
                self._lookups.popitem(last=False)
        return match

    def start_load(self, request_id: str, block_hashes: Sequence[bytes], dst_block_ids: Sequence[int]) -> None:
        """Load the blocks of ``block_hashes`` into ``dst_block_ids`` (same length), asynchronously.

        The outcome arrives through :meth:`get_finished`. Uses the source the
        last :meth:`lookup` of these hashes chose (or looks up again).
        """
        self._leader_only("start_load")
        if len(block_hashes) != len(dst_block_ids) or not block_hashes:
            raise ValueError(f"start_load({request_id!r}): {len(block_hashes)} hashes for "
                             f"{len(dst_block_ids)} destination blocks")
        self._events.put(("start", (request_id, list(block_hashes), [int(b) for b in dst_block_ids])))

    def get_finished(self) -> tuple[set[str], set[str]]:
        """Request ids whose load finished since the last call: ``(done, failed)``. Never blocks."""
        with self._lock:
            done, failed = self._done, self._failed
            self._done, self._failed = set(), set()
        return done, failed

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
        if self._coordinator is not None:
            self._events.put(("stop", None))
            self._coordinator.join(10)
        if self._worker is not None:
            self._worker.close()
        if self._server is not None:
            self._server.close()
            release_ipc_path(self._endpoints[self.rank] if self._endpoints else "")
        for c in [*self._ranks.values(), *self._sources.values(), *([self._leader] if self._leader else [])]:
            c.close()
        if self._registry is not None:
            self._registry.close()

    def _leader_only(self, what: str) -> None:
        if self.rank != 0:
            raise ConfigError(f"{what} is called on target rank 0 (the leader), not rank {self.rank}")
        if self._closed:
            raise ConfigError(f"{what}: the target client is shut down")

    # -- rank > 0 ----------------------------------------------------------------------------

    def _target_load(self, req: TargetLoad, ctx: CallContext) -> TargetAck:
        if self._closed or self._worker is None:
            return TargetAck(False, "shutting down")
        self._worker.submit(req)
        return TargetAck(True)

    def _report_to_leader(self, done: TargetDone) -> None:
        # Called only from this rank's worker thread, so one client (socket) serves every report.
        if self._leader is None:
            self._leader = RpcClient(self._endpoints[0], timeout_ms=float(self.config.rpc_timeout_ms))
        self._leader.call(done)

    # -- the leader's coordinator ----------------------------------------------------------------

    def _target_done(self, req: TargetDone, ctx: CallContext) -> TargetAck:
        self._events.put(("done", req))
        return TargetAck(True)

    def _on_local_done(self, done: TargetDone) -> None:
        self._events.put(("done", done))

    def _coordinate(self) -> None:
        while True:
            try:
                kind, item = self._events.get(timeout=0.05)
            except queue.Empty:
                kind, item = "tick", None
            try:
                if kind == "stop":
                    break
                if kind == "start":
                    self._begin(*item)
                elif kind == "done":
                    self._rank_done(item)
                self._check_clocks()
            except Exception:  # pragma: no cover - a bug must not stop every later load
                log.exception("target coordinator: handling %s failed", kind)
        for load in list(self._loads.values()):
            self._fail(load, "the target client shut down")

    def _begin(self, request_id: str, hashes: list[bytes], dst: list[int]) -> None:
        load = _Load(next(self._ids), request_id, dst)
        self.stats["loads"] += 1
        with self._lock:
            match = self._lookups.pop(tuple(hashes), None)
        if match is None:
            match = self.lookup(hashes)
        if match.reason != "ok" or match.endpoint is None or match.worker_id is None:
            self._finish(load, f"lookup: {match.reason}", ok=False)
            return
        n = min(match.matched, len(hashes))
        load.source = self._source_client(match.endpoint)
        epoch_infos = self._source_infos.get(match.worker_id)
        known = sorted(epoch_infos[2]) if epoch_infos else []
        try:
            reply = load.source.call(Resolve(hashes[:n], self.config.lease_ttl_ms, self.worker_id, known))
        except RemoteG2Error as e:
            self._finish(load, f"resolve on {match.worker_id}: {type(e).__name__}: {e}", ok=False)
            return
        load.lease_id = reply.lease_id
        if reply.reason != "ok" or reply.matched == 0:
            self._finish(load, f"resolve on {match.worker_id}: {reply.reason}", ok=False)
            return
        try:
            infos, first_time = self._source_ranks(load.source, match.worker_id, reply.epoch, reply.metadata)
        except RemoteG2Error as e:
            self._finish(load, f"get_metadata on {match.worker_id}: {e}", ok=False)
            return
        m = reply.matched
        load.invalid_tail = dst[m:]
        load.dst = dst[:m]
        now = time.monotonic()
        load.deadline = now + (self.config.transfer_timeout_ms + self.config.rpc_timeout_ms) / 1000.0
        load.renew_at = now + reply.expires_in_ms / 2000.0
        load.waiting = set(range(self.tp_size))
        self._loads[load.load_id] = load
        mla_offset = zlib.crc32(self.worker_id.encode()) % max(1, len(infos))
        is_mla = bool(self.config.fingerprint and self.config.fingerprint.is_mla)
        msg = TargetLoad(load.load_id, match.worker_id, reply.epoch, len(infos), is_mla, mla_offset, reply.ranks,
                         [info if info.agent_name in first_time else replace(info, agent_metadata=None)
                          for info in infos], load.dst, self.config.transfer_timeout_ms)
        assert self._worker is not None
        self._worker.submit(msg)
        for r, rank_client in self._ranks.items():
            try:
                ack = rank_client.call(msg)
                if not ack.accepted:
                    raise TransferError(ack.detail)
            except RemoteG2Error as e:
                load.waiting.discard(r)
                load.errors.append(f"rank {r}: target_load refused: {e}")

    def _source_ranks(self, source: RpcClient, worker: str, epoch: int,
                      metadata: list[RankInfo]) -> tuple[list[RankInfo], set[str]]:
        """Every source rank's info for this epoch, and the agents whose metadata goes out for the first time."""
        entry = self._source_infos.get(worker)
        if entry is None or entry[0] != epoch:
            entry = (epoch, {}, set())
            self._source_infos[worker] = entry
        _, infos, sent = entry
        for info in metadata:
            if info.agent_metadata is not None or info.rank not in infos:
                infos[info.rank] = info
        if any(info.agent_metadata is None and info.agent_name not in sent for info in infos.values()) or not infos:
            full = source.call(GetMetadata())
            for info in full.ranks:
                infos[info.rank] = info
        first_time = {info.agent_name for info in infos.values() if info.agent_name not in sent}
        sent.update(first_time)
        return [infos[r] for r in sorted(infos)], first_time

    def _source_client(self, endpoint: str) -> RpcClient:
        c = self._sources.get(endpoint)
        if c is None:
            c = self._sources[endpoint] = RpcClient(endpoint, timeout_ms=float(self.config.rpc_timeout_ms))
        return c

    def _rank_done(self, done: TargetDone) -> None:
        load = self._loads.get(done.load_id)
        if load is None or done.rank not in load.waiting:
            return
        load.waiting.discard(done.rank)
        if done.ok:
            self.stats["bytes"] += done.nbytes
            self.stats["descriptors"] += done.descriptors
        else:
            load.errors.append(f"rank {done.rank}: {done.error}")
        if not load.waiting:
            self._complete(load)

    def _complete(self, load: _Load) -> None:
        """Every rank answered: release the lease, then report."""
        self._loads.pop(load.load_id, None)
        released = self._release(load)
        if load.errors:
            self._finish(load, "; ".join(load.errors), ok=False, released=True)
        elif not released:
            self._finish(load, "the lease expired on the source before the load finished", ok=False,
                         released=True)
        else:
            self._finish(load, None, ok=True, released=True)

    def _check_clocks(self) -> None:
        now = time.monotonic()
        for load in list(self._loads.values()):
            if now > load.deadline:
                load.errors.append(f"rank(s) {sorted(load.waiting)} did not answer in time")
                load.waiting.clear()
                self._complete(load)
            elif now > load.renew_at and load.source is not None:
                load.renew_at = now + self.config.lease_ttl_ms / 2000.0
                try:
                    if not load.source.call(Renew(load.lease_id, self.config.lease_ttl_ms)).renewed:
                        load.errors.append("the source dropped the lease before the load finished")
                except RemoteG2Error as e:
                    log.warning("renewing lease %d: %s", load.lease_id, e)

    def _release(self, load: _Load) -> bool:
        if not load.lease_id or load.source is None:
            return False
        try:
            return bool(load.source.call(Release(load.lease_id)).released)
        except RemoteG2Error as e:
            log.warning("releasing lease %d: %s", load.lease_id, e)
            return False

    def _fail(self, load: _Load, why: str) -> None:
        self._loads.pop(load.load_id, None)
        self._finish(load, why, ok=False)

    def _finish(self, load: _Load, error: str | None, *, ok: bool, released: bool = False) -> None:
        if not released and load.lease_id:
            self._release(load)
        with self._lock:
            if ok:
                self._done.add(load.request_id)
                self._invalid.update(load.invalid_tail)
            else:
                self._failed.add(load.request_id)
                self._invalid.update(load.dst)
                self._invalid.update(load.invalid_tail)
        self.stats["done" if ok else "failed"] += 1
        if error:
            log.warning("load of %s failed after %.1f ms: %s", load.request_id,
                        (time.monotonic() - load.started) * 1e3, error)
