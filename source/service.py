"""The source service: one per TP rank of a worker that shares its G2 pool.

Start-up (every rank, :func:`start_source_service`):

1. create the rank's NIXL agent ``remote-g2-source-{worker_id}-tp{rank}`` and
   register the pool's memory;
2. ranks > 0 bind their sibling IPC socket and start serving it;
3. one MPI allgather over the TP group of ``(agent name, agent metadata,
   pool base, pool bytes, layout, sibling endpoint)`` — the only MPI call;
4. rank 0 serves ``resolve`` / ``release`` / ``renew`` / ``get_metadata`` on
   TCP and, with a registry configured, registers the worker and streams the
   pool's stored/removed events (heartbeat load = open leases).

Rank 0's ``resolve`` / ``release`` / ``renew`` / ``get_metadata`` and their
fan-out to the siblings are an object of their own,
:class:`~.rank0_rpc.Rank0Handlers`, which the service builds over its lease
state and registers on its servers.

Every rank reaps its own expired leases from a bounded sleep loop, so a
reader that dies never leaks pins.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from remote_g2.memory.secondary_pool import MemoryRegion, SecondaryPool
from remote_g2.config import env_flag
from remote_g2.errors import ProtocolError, SourceError
from remote_g2.rpc.ipc_paths import (
    claim_ipc_path,
    default_ipc_dir,
    ipc_endpoint,
    prepare_ipc_dir,
    release_ipc_path,
)
from remote_g2.log import RateLimitedLog, cpu_set_text
from remote_g2.rpc.net_address import (
    advertised_endpoint, apply_advertise, default_bind_host, split_tcp, toward_registry, with_host,
)
from remote_g2.protocol.messages import RankInfo
from remote_g2.rpc.server import Handler, RpcServer, free_port_on_host_of
from remote_g2.rpc.stream import StreamRpcServer, stream_endpoint_on_host_of
from remote_g2.stall_watchdog import maybe_start_stall_watchdog
from remote_g2.tp.group import RankRecord, TpGroup, exchange
from remote_g2.tp.start import start_on_every_rank

from .config import ENABLE_ENV, SourceConfig
from .gather import GATHER_OUTCOMES, Gatherer
from .leases import LeaseTable, PinBudget
from .metrics import SourceMetrics
from .peer import peer_handlers
from .rank_agent import RankAgent, agent_name_for
from .rank0_rpc import Rank0Handlers
from .siblings import SiblingLinks, sibling_handlers
from .staging import StagingArena

__all__ = ["SourceService", "start_source_service", "maybe_start_source_service"]

log = logging.getLogger("remote_g2.source")

STALL_WARN_S = 1.0  # a reaper this late is logged: the process did not run for that long


def maybe_start_source_service(pool: SecondaryPool, *, worker_id: str, tp_rank: int | None = None,
                               tp_size: int | None = None, config: SourceConfig | None = None,
                               comm: Any = None) -> SourceService | None:
    """Start this rank's source service when enabled; otherwise do nothing and return None.

    Enabled by ``config.enabled`` or ``REMOTE_G2_SOURCE=1`` (``config=None``
    reads every setting from the environment, see :class:`SourceConfig`).
    Call it on every rank of the worker: start-up has one collective over the
    TP group (``comm``; default: MPI world split into groups of ``tp_size``
    consecutive ranks, itself collective over MPI world). It returns once
    this rank serves; rank 0 has announced the worker to the registry by
    then (asynchronously: registration is retried in the background).

    Raises :class:`ConfigError` for bad settings and :class:`SourceError`
    when start-up failed on any rank (every rank raises).
    """
    if config is None:
        config = SourceConfig.from_env()
    elif not config.enabled and os.environ.get(ENABLE_ENV, "").strip() and env_flag(ENABLE_ENV):
        config = replace(config, enabled=True)
    if not config.enabled:
        log.debug("source service disabled (set %s=1 or SourceConfig.enabled)", ENABLE_ENV)
        return None
    return start_source_service(pool, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size, config=config,
                                comm=comm)


def start_source_service(pool: SecondaryPool, *, worker_id: str, tp_rank: int | None = None,
                         tp_size: int | None = None, config: SourceConfig | None = None,
                         comm: Any = None) -> SourceService:
    """Start this rank's source service unconditionally (see :func:`maybe_start_source_service`)."""
    config = config or SourceConfig(enabled=True)
    return start_on_every_rank(lambda group: SourceService(pool, worker_id=worker_id, group=group, config=config),
                               SourceService._start, worker_id=worker_id, tp_rank=tp_rank, tp_size=tp_size,
                               comm=comm)


class SourceService:
    """One rank's part of a worker's source; built by :func:`start_source_service`.

    ``endpoint`` is rank 0's bound TCP endpoint (what targets call), or a
    sibling's IPC endpoint. :meth:`shutdown` is idempotent and also runs at
    interpreter exit.
    """

    def __init__(self, pool: SecondaryPool, *, worker_id: str, group: TpGroup, config: SourceConfig) -> None:
        self.pool = pool
        self.worker_id = worker_id
        self.group = group
        self.rank = group.rank
        self.tp_size = group.size
        self.config = config
        self.epoch = 0
        self.endpoint: str | None = None
        self.advertised_endpoint: str | None = None  # rank 0: what the registry is told (see _advertised)
        self.metrics = SourceMetrics(self.rank)
        layout = pool.layout
        budget_blocks = config.pin_budget_blocks or max(1, layout.num_blocks // 2)
        # Every rank bounds its own pins (a sibling's too: target ranks may resolve their share with it).
        self.budget = PinBudget(budget_blocks, on_change=self.metrics.budget_available.set)
        self.metrics.budget_available.set(budget_blocks)
        self._agent: RankAgent | None = None  # before the lease table: its on_change hook wakes the agent
        self.staging: StagingArena | None = None  # made with the agent (registered with it); see source/gather.py
        self.gatherer: Gatherer | None = None
        self.leases = LeaseTable(pool, budget=self.budget, tombstone_ttl_s=config.max_lease_ttl_ms / 1000 * 2,
                                 on_change=self._lease_table_changed, on_end=self._lease_ended)
        self.records: list[RankRecord] = []
        self._server: RpcServer | None = None
        self._peer_server: RpcServer | None = None  # peer_resolve / release (/ renew on rank 0); see _start_peer_server
        self.peer_endpoint: str | None = None
        self._links: SiblingLinks | None = None
        self._publisher: Any = None
        self._registry_client: Any = None
        self._rank0: Rank0Handlers | None = None  # rank 0's lease RPCs; see _start_rank0
        self._stop = threading.Event()
        self._reaper: threading.Thread | None = None
        self._shutdown_lock = threading.Lock()
        self._closed = False
        self._started_at = time.monotonic()
        self._log_limited = RateLimitedLog(log)  # what clients can cause at will is logged once a minute
        self._max_wakeup_lag = 0.0  # seconds: the longest time the reaper woke late (see _note_wakeup_lag)

    def _lease_table_changed(self, open_leases: int, pinned: int) -> None:
        self.metrics.lease_table_changed(open_leases, pinned)
        agent = self._agent  # None until _start_local made it
        if open_leases and agent is not None:  # a reader is about to READ: progress now, then at its pace
            agent.wake()

    def _lease_ended(self, lease_id: int) -> None:
        staging = self.staging
        if staging is not None:  # its staged ranges go with its pins
            staging.release(lease_id)

    # -- start-up --------------------------------------------------------------------------

    def _start(self) -> None:
        cfg = self.config
        maybe_start_stall_watchdog()  # REMOTE_G2_STALL_DUMP_S: stacks to stderr when Python stalls
        record: RankRecord | None = None
        error: str | None = None
        try:
            record = self._start_local()
        except Exception as e:  # tell the other ranks instead of leaving them in the allgather
            log.exception("source rank %d failed to start", self.rank)
            error = f"{type(e).__name__}: {e}"
        self.records = exchange(self.group, record, error)
        self.epoch = self.records[0].epoch  # rank 0's: one epoch for the whole worker
        self._reaper = threading.Thread(target=self._reap_loop, name=f"source-reaper-tp{self.rank}", daemon=True)
        self._reaper.start()
        if self.rank == 0:
            self._start_rank0()
        if cfg.metrics_port is not None:
            self.metrics.serve_http(cfg.metrics_port + self.rank if cfg.metrics_port else 0, cfg.metrics_addr)
        _live_services.add(self)
        log.info("source %s rank %d/%d serving on %s (threads on CPUs %s)", self.worker_id, self.rank, self.tp_size,
                 self.endpoint, cpu_set_text())

    def _routable_addresses(self) -> None:
        """``bind`` chosen when unset and ``advertise`` filled in, by :mod:`remote_g2.rpc.net_address`'s rule.

        Every rank computes the same (same settings, same host); a bind or an
        advertise address that targets elsewhere could not dial is a
        ConfigError here, before anything is bound or announced.
        """
        cfg = self.config
        toward = toward_registry(cfg.registry_endpoint)
        bind = cfg.bind or f"tcp://{default_bind_host(toward)}:0"
        advertise = advertised_endpoint(bind, advertise=cfg.advertise, toward=toward,
                                        what=f"source {self.worker_id}", bind_setting="REMOTE_G2_SOURCE_BIND",
                                        advertise_setting="REMOTE_G2_SOURCE_ADVERTISE")
        self.config = replace(cfg, bind=bind, advertise=None if advertise == bind else advertise)

    def _advertised(self, bound: str, *, own_port: bool) -> str:
        """What others are told for a server bound at ``bound``: ``advertise``'s host (and port, unless
        ``own_port`` or it is 0), else ``bound`` itself."""
        advertise = self.config.advertise
        if advertise is None:
            return bound
        return with_host(bound, split_tcp(advertise)[1]) if own_port else apply_advertise(bound, advertise)

    def _start_local(self) -> RankRecord:
        """Agent, registered memory and (rank > 0) the sibling socket; this rank's record."""
        self._routable_addresses()
        cfg = self.config
        regions = self.pool.regions()
        layout = self.pool.layout
        if not regions:
            raise SourceError("the pool has no memory regions")
        if regions[0].nbytes < layout.num_blocks * layout.block_bytes:
            raise SourceError(f"pool region 0 is {regions[0].nbytes} bytes, the layout needs "
                              f"{layout.num_blocks} x {layout.block_bytes}")
        staging_regions: list[MemoryRegion] = []
        if cfg.staging_mib:
            self.staging = StagingArena(cfg.staging_mib << 20, on_change=self.metrics.staging_in_use.set)
            staging_regions = [MemoryRegion(self.staging.base, self.staging.nbytes)]
            self.gatherer = Gatherer(self.staging, rank=self.rank, source_tp=self.tp_size, layout=layout,
                                     pool_base=regions[0].base, min_descriptors=cfg.gather_min_descriptors,
                                     max_piece_bytes=cfg.gather_max_piece_kib << 10,
                                     chunk_bytes=cfg.gather_chunk_kib << 10, observe=self.metrics.gather_outcome)
        self._agent = RankAgent(agent_name_for(self.worker_id, self.rank), list(regions) + staging_regions,
                                readers=self.leases.readers, pace=cfg.progress_pace())
        self._agent.start_progress()
        self.metrics.progress_mode.labels(self._agent.progress_mode).set(1)
        sibling_endpoint = None
        if self.rank > 0:
            directory = prepare_ipc_dir(cfg.ipc_dir or default_ipc_dir())
            sibling_endpoint = ipc_endpoint(directory, self.worker_id, self.rank)
            claim_ipc_path(sibling_endpoint)
            self._server = RpcServer(sibling_endpoint,
                                     sibling_handlers(self.leases, max_ttl_ms=cfg.max_lease_ttl_ms,
                                                      lease_ttl_ms=cfg.lease_ttl_ms,
                                                      on_release=self.metrics.leases_released.inc,
                                                      gatherer=self.gatherer),
                                     name=f"source-{self.worker_id}-tp{self.rank}", workers=1,
                                     on_call=self.metrics.observe_call)
            self.endpoint = self._server.start()
            if cfg.peer_resolve:
                self._start_peer_server(peer_handlers(self.leases, epoch=lambda: self.epoch,
                                                      lease_ttl_ms=cfg.lease_ttl_ms,
                                                      on_release=self.metrics.leases_released.inc,
                                                      gatherer=self.gatherer))
        epoch = time.time_ns() if self.rank == 0 else 0
        staging = self.staging
        return RankRecord(self.rank, self._agent.name, self._agent.metadata, regions[0].base, regions[0].nbytes,
                          layout, sibling_endpoint, epoch, self.peer_endpoint,
                          staging.base if staging else 0, staging.nbytes if staging else 0)

    def _start_peer_server(self, handlers: dict[str, Handler]) -> None:
        """Serve a peer load's calls to this rank (source/peer.py) at ``peer_endpoint``.

        Rank r > 0: ``peer_resolve`` / ``release`` of its own shares. Rank 0
        (stream lane only; otherwise its worker endpoint serves them):
        ``peer_resolve`` and the worker's ``release`` / ``renew``, which reach
        the siblings — a lease is ended from the connection that took it.
        Bound on rank 0's host (``bind``) at a port of its own; advertised on
        ``advertise``'s host when one is set. The stream lane when
        ``config.stream_lane``, else ZMQ TCP with rank 0's CURVE keys.
        """
        cfg = self.config
        assert cfg.bind is not None  # _routable_addresses chose it
        name = f"source-{self.worker_id}-tp{self.rank}-peer"
        if cfg.stream_lane:
            self._peer_server = StreamRpcServer(stream_endpoint_on_host_of(cfg.bind), handlers, name=name,
                                                on_call=self.metrics.observe_call)
        else:
            self._peer_server = RpcServer(free_port_on_host_of(cfg.bind), handlers, name=name, workers=1,
                                          curve=cfg.curve, on_call=self.metrics.observe_call, identify_clients=True)
        self.peer_endpoint = self._advertised(self._peer_server.start(), own_port=True)

    def _start_rank0(self) -> None:
        cfg = self.config
        rank_infos = [RankInfo(r.rank, r.agent_name, r.agent_metadata, r.pool_base, r.pool_bytes, r.layout,
                               r.peer_endpoint, r.staging_base, r.staging_bytes) for r in self.records]
        siblings = {r.rank: r.sibling_endpoint for r in self.records[1:] if r.sibling_endpoint}
        self._links = SiblingLinks(siblings, timeout_ms=cfg.sibling_timeout_ms,
                                   retry_after_s=cfg.sibling_retry_after_ms / 1000,
                                   on_failure=self._sibling_failed, on_refusal=self._sibling_refused)
        rank0 = self._rank0 = Rank0Handlers(worker_id=self.worker_id, epoch=self.epoch, tp_size=self.tp_size,
                                            config=cfg, metrics=self.metrics, budget=self.budget, leases=self.leases,
                                            links=self._links, gatherer=self.gatherer, rank_infos=rank_infos)
        peer_resolve = peer_handlers(self.leases, epoch=lambda: self.epoch, lease_ttl_ms=cfg.lease_ttl_ms,
                                     observe=self.metrics.resolve_outcome, gatherer=self.gatherer)["peer_resolve"]
        if cfg.stream_lane:  # before the worker endpoint: targets learn of the lane from its metadata
            self._start_peer_server({"peer_resolve": peer_resolve, "release": rank0.release, "renew": rank0.renew})
            rank0.rank_infos[0] = replace(rank0.rank_infos[0], peer_endpoint=self.peer_endpoint)
        assert cfg.bind is not None  # _routable_addresses chose it
        self._server = RpcServer(cfg.bind, {
            "resolve": rank0.resolve,
            "release": rank0.release,
            "renew": rank0.renew,
            "get_metadata": rank0.get_metadata,
            "peer_resolve": peer_resolve,
        }, name=f"source-{self.worker_id}", workers=cfg.rpc_workers, curve=cfg.curve,
            on_call=self.metrics.observe_call, on_arrival={"resolve": rank0.forward_resolve}, identify_clients=True)
        self.endpoint = self._server.start()
        self.advertised_endpoint = self._advertised(self.endpoint, own_port=False)
        if self.advertised_endpoint != self.endpoint:
            log.info("source %s advertises %s (bound %s)", self.worker_id, self.advertised_endpoint, self.endpoint)
        if cfg.registry_endpoint:
            self._start_publisher(self.advertised_endpoint)

    def _start_publisher(self, endpoint: str) -> None:
        from remote_g2.registry import RegistryClient, SourcePublisher

        fingerprint = self.config.fingerprint
        assert fingerprint is not None  # SourceConfig checks it
        if fingerprint.tp_size != self.tp_size:
            log.warning("fingerprint says tp_size=%d, the TP group has %d ranks: announcing %d",
                        fingerprint.tp_size, self.tp_size, self.tp_size)
            fingerprint = replace(fingerprint, tp_size=self.tp_size)
        self._registry_client = RegistryClient(self.config.registry_endpoint, timeout_s=self.config.registry_timeout_s,
                                               curve=self.config.registry_curve)
        self._publisher = SourcePublisher(self._registry_client, worker_id=self.worker_id, endpoint=endpoint,
                                          fingerprint=fingerprint, snapshot=self.pool.block_hashes,
                                          load=lambda: self.leases.open_leases)
        # Listener first: the registration's snapshot covers whatever happened before it.
        self.pool.add_listener(self._pool_event)
        self._publisher.start()

    def _pool_event(self, kind: str, hashes: Sequence[bytes]) -> None:
        publisher = self._publisher
        if publisher is None:  # shut down: the pool keeps calling us, we ignore it
            return
        if kind == "stored":
            publisher.stored(hashes)
        elif kind == "removed":
            publisher.removed(hashes)
        elif kind == "cleared":
            publisher.cleared()

    def _sibling_failed(self, rank: int, call: str, error: Exception) -> None:
        """A sibling left a call unanswered: it hung, died or is starved (what operators page on)."""
        self.metrics.sibling_failures.labels(str(rank), call).inc()
        self._log_limited.warning(("failed", rank, call), "source %s: %s on TP rank %d failed: %s", self.worker_id,
                                  call, rank, error)

    def _sibling_refused(self, rank: int, call: str, error: Exception) -> None:
        """A sibling answered ERR: alive. A malformed target frame was refused (and counted) by rank 0 too."""
        if isinstance(error, ProtocolError) and call == "sibling_resolve":
            return
        name = type(error).__name__
        self.metrics.sibling_refusals.labels(str(rank), call, name).inc()
        self._log_limited.warning(("refused", rank, call, name), "source %s: TP rank %d refused %s: %s: %s",
                                  self.worker_id, rank, call, name, error)

    # -- every rank ----------------------------------------------------------------------------

    def _reap_loop(self) -> None:
        interval = self.config.reap_interval_ms / 1000.0
        while not self._stop.is_set():
            try:
                expired = self.leases.reap()
                if expired:
                    self.metrics.leases_expired.inc(len(expired))
                    log.info("source %s rank %d: %d lease(s) expired without release (%d blocks)",
                             self.worker_id, self.rank, len(expired), sum(len(x.block_ids) for x in expired))
            except Exception:
                log.exception("source %s rank %d: lease reaper failed", self.worker_id, self.rank)
            nxt = self.leases.next_deadline()
            wait = interval if nxt is None else min(interval, max(0.001, nxt - time.monotonic()))
            due = time.monotonic() + wait
            if self._stop.wait(wait):
                return
            self._note_wakeup_lag(time.monotonic() - due)

    def _note_wakeup_lag(self, lag: float) -> None:
        """Record how late the reaper woke; say so in the log when this process did not run for a while.

        Nothing else in the log would explain the gap: resolves and heartbeats simply stopped
        (docs/operations.md, on-call step 8).
        """
        lag = max(0.0, lag)
        self.metrics.wakeup_lag.observe(lag)
        self._max_wakeup_lag = max(self._max_wakeup_lag, lag)
        if lag >= STALL_WARN_S:
            log.warning("source %s rank %d: this process did not run for %.1f s (threads on CPUs %s; a CPU "
                        "taken by other work, a C call holding the GIL, or a stopped process): resolves and "
                        "heartbeats waited as long", self.worker_id, self.rank, lag, cpu_set_text())

    def stats(self) -> dict[str, Any]:
        """This rank's numbers (leases, pins, budget, NIXL agent); for logs, tests and benchmarks."""
        return {
            "worker_id": self.worker_id,
            "rank": self.rank,
            "tp_size": self.tp_size,
            "endpoint": self.endpoint,
            "epoch": self.epoch,
            "leases_open": self.leases.open_leases,
            "blocks_pinned": self.leases.pinned_blocks,
            "budget_available": self.budget.available,
            "staging_in_use": self.staging.in_use if self.staging is not None else 0,
            "gathers": {o: int(self.metrics.value("remote_g2_source_gathers_total", {"outcome": o}))
                        for o in GATHER_OUTCOMES},
            "peer_endpoint": self.peer_endpoint,
            "leases_expired": int(self.metrics.value("remote_g2_source_leases_expired_total")),
            "leases_released": int(self.metrics.value("remote_g2_source_leases_released_total")),
            "sibling_failures": int(self.metrics.total("remote_g2_source_sibling_failures_total")),
            "sibling_refusals": int(self.metrics.total("remote_g2_source_sibling_refusals_total")),
            "bad_requests": int(self.metrics.total("remote_g2_source_requests_total", outcome="bad_request")),
            "uptime_s": time.monotonic() - self._started_at,
            "max_wakeup_lag_s": self._max_wakeup_lag,
        }

    def shutdown(self) -> None:
        """Stop serving and drop everything, in order; idempotent.

        Rank 0 first tells the registry its blocks are gone (best effort), then
        every rank stops its server, drops every lease's pins, stops the reaper
        and tears down NIXL (progress thread, memory, agent). The pool itself
        is the engine's and stays as it is (minus our pins).
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        _live_services.discard(self)
        publisher, self._publisher = self._publisher, None
        if publisher is not None:
            try:
                publisher.cleared()
                publisher.close(flush_timeout_s=1.0)
            except Exception:
                log.exception("source %s: closing the registry publisher failed", self.worker_id)
        if self._registry_client is not None:
            try:
                self._registry_client.close()
            except Exception:
                pass
        if self._server is not None:
            self._server.close()
            if self.rank > 0 and self.endpoint and self.endpoint.startswith("ipc://"):
                release_ipc_path(self.endpoint)
        if self._peer_server is not None:
            self._peer_server.close()
        if self._links is not None:
            self._links.close()
        self._stop.set()
        if self._reaper is not None:
            self._reaper.join(5)
        dropped = self.leases.release_all()
        if dropped:
            log.info("source %s rank %d: dropped %d open lease(s) at shutdown", self.worker_id, self.rank, dropped)
        if self.gatherer is not None:  # before the agent: no gather writes into memory being deregistered
            self.gatherer.close()
        if self._agent is not None:
            self._agent.close()
        self.metrics.close()
        log.info("source %s rank %d stopped", self.worker_id, self.rank)

    def __enter__(self) -> SourceService:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


_live_services: weakref.WeakSet[SourceService] = weakref.WeakSet()


@atexit.register
def _shutdown_at_exit() -> None:
    # NIXL tends to crash at interpreter exit when agents die late and in no order.
    for service in list(_live_services):
        try:
            service.shutdown()
        except Exception:
            log.exception("source shutdown at exit failed")
