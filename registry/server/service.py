"""The registry server: registry messages over the shared RPC layer, in front of a store.

Stateless over Redis: every answer comes from the store, so any number of
servers can front one Redis (or Redis Cluster) and give the same answers. The
only per-process state is counters (``stats``, Prometheus) and the round-robin
tie-breaker.

With ``feed_bind`` the server also publishes every write it applied on a
change feed (:mod:`.feed`), and answers ``feed_info`` and ``scan_worker``, so
a :class:`~registry.mirror.RegistryMirror` can keep an in-process copy.

With ``mirror_lookups`` (Redis backends) the server keeps such a copy itself,
following its own feed and its ``mirror_peers``' (the other servers in front
of the same store), and answers lookups from memory instead of running the
lookup script; writes still go to the store. While the copy is incomplete
lookups go to the store as usual. A lookup may then miss a write made a feed
hop ago — a registry answer is a hint the source's resolve checks, so that
costs at most a shorter match (docs/architecture.md).

A registration is checked against :mod:`remote_g2.rpc.net_address`'s rule, as
a second line behind the source's own check: an endpoint on a wildcard
address is refused (``ERR RegistryError``: no target could dial it); one on
loopback is refused by a registry bound to a routable address (the source
reached it from elsewhere) and flagged — logged, counted in
``remote_g2_registry_endpoint_checks`` — by one bound to a wildcard, which
cannot tell a same-host source from a remote one.

A background thread sweeps dead and superseded incarnations and refreshes the
size gauges. A store that cannot reach Redis answers ``ERR StoreUnavailable``;
the server keeps serving and recovers by itself when Redis is back.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from remote_g2.rpc.curve import CurveClientConfig, CurveServerConfig
from remote_g2.errors import ConfigError, RegistryError, StoreUnavailable
from remote_g2.log import RateLimitedLog
from remote_g2.protocol.messages import (
    DrainWorker, DrainWorkerReply, Events, EventsReply, FeedInfo, FeedInfoReply, Heartbeat, HeartbeatReply,
    ListWorkers, ListWorkersReply, Lookup, LookupReply, RegisterWorker, RegisterWorkerReply, Resync, ResyncReply,
    ScanWorker, ScanWorkerReply, Stats, StatsReply, WhoHas, WhoHasReply, WorkerInfo, WorkerInfoReply,
)
from remote_g2.rpc.net_address import apply_advertise, is_loopback, is_wildcard, split_tcp
from remote_g2.rpc.server import CallContext, RpcServer

from .feed import DEFAULT_TICK_S, FeedPublisher
from ..metrics import RegistryMetrics
from ..client.mirror import RegistryMirror
from ..stores.contract import ConvertedLookups, RegistryStore

__all__ = ["RegistryServer", "DEFAULT_BIND", "endpoint_verdict"]

log = logging.getLogger("remote_g2.registry")

DEFAULT_BIND = "tcp://127.0.0.1:7450"


def endpoint_verdict(endpoint: str, registry: str) -> str | None:
    """What a registry bound at ``registry`` makes of a worker's ``endpoint`` (module docstring):
    ``"wildcard"`` / ``"loopback"`` (refused), ``"flagged"`` (a loopback endpoint, a wildcard-bound
    registry), or None (fine; ipc:// and other schemes are the integration's own business)."""
    try:
        _, host, _ = split_tcp(endpoint)
    except ConfigError:
        return None
    if is_wildcard(host):
        return "wildcard"
    if not is_loopback(host) or not registry.startswith("tcp://"):
        return None
    _, own_host, _ = split_tcp(registry)
    if is_loopback(own_host):
        return None  # a registry on loopback: everyone is on this host
    return "flagged" if is_wildcard(own_host) else "loopback"


class RegistryServer:
    """Serve a :class:`RegistryStore` on ``bind``; ``start()`` returns the bound endpoint."""

    def __init__(
        self,
        store: RegistryStore,
        *,
        bind: str = DEFAULT_BIND,
        workers: int = 1,
        curve: CurveServerConfig | None = None,
        metrics: RegistryMetrics | None = None,
        sweep_interval_s: float = 1.0,
        feed_bind: str | None = None,
        feed_tick_s: float = DEFAULT_TICK_S,
        feed_advertise: str | None = None,
        mirror_lookups: bool = False,
        mirror_peers: Sequence[str] = (),
    ) -> None:
        if mirror_lookups and not feed_bind:
            raise ConfigError("mirror_lookups needs a change feed (feed_bind)")
        self.store = store
        self._curve = curve
        self._feed_bind = feed_bind
        self._feed_tick_s = feed_tick_s
        self._feed_advertise = feed_advertise
        self._flag_log = RateLimitedLog(log)
        self.feed: FeedPublisher | None = None
        self._mirror_lookups = mirror_lookups
        self._mirror_peers = list(mirror_peers)
        self.mirror: RegistryMirror | None = None
        self.metrics = metrics or RegistryMetrics()
        self._rr = itertools.count()
        self._lookups = 0
        self._hits = 0
        self._events = 0
        self._counter_lock = threading.Lock()
        self._sweep_interval = sweep_interval_s
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self._t0 = time.monotonic()
        handlers: dict[str, Callable[[Any, CallContext], Any]] = {
            "register_worker": self._register_worker,
            "heartbeat": self._heartbeat,
            "events": self._events_batch,
            "resync": self._resync,
            "who_has": self._who_has,
            "worker_info": self._worker_info,
            "list_workers": self._list_workers,
            "stats": self._stats,
            "drain_worker": self._drain_worker,
            "feed_info": self._feed_info,
            "scan_worker": self._scan_worker,
        }
        self._rpc = RpcServer(bind, {k: self._guard(v) for k, v in handlers.items()}, name="registry",
                              workers=workers, curve=curve, on_call=self.metrics.observe_call,
                              batch_handlers={"lookup": self._guard(self._lookups_batch)})

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> str:
        self.store.prepare()
        endpoint = self._rpc.start()
        if self._feed_bind:
            self.feed = FeedPublisher(self._feed_bind, context=self._rpc.context, curve=self._curve,
                                      tick_s=self._feed_tick_s)
            log.info("change feed on %s (instance %s)", self.feed.endpoint, self.feed.instance)
        if self._mirror_lookups:
            # The copy reads from this server (and its peers, which share its key pair) as a CURVE client
            # with the server's own keys: an allow-list must list the server's public key.
            client_curve = (CurveClientConfig(self._curve.public_key, self._curve.public_key, self._curve.secret_key)
                            if self._curve is not None else None)
            self.mirror = RegistryMirror([endpoint, *self._mirror_peers], curve=client_curve).start()
        self._sweeper = threading.Thread(target=self._sweep_loop, name="registry-sweeper", daemon=True)
        self._sweeper.start()
        log.info("registry on %s (store: %s, lease %d ms)", endpoint, self.store.name, self.store.lease_ttl_ms)
        return endpoint

    @property
    def endpoint(self) -> str:
        return self._rpc.endpoint

    @property
    def feed_endpoint(self) -> str:
        """The change feed's endpoint as mirrors are told: ``feed_advertise``'s host (port 0: the bound
        port) when set, else the bound one (a wildcard one is dialled at the server's host; see
        :func:`~registry.mirror.feed_endpoint_from`); "" without a feed."""
        if self.feed is None:
            return ""
        if not self._feed_advertise:
            return self.feed.endpoint
        return apply_advertise(self.feed.endpoint, self._feed_advertise)

    def close(self) -> None:
        """Stop serving and sweeping; the store is the caller's to close."""
        self._stop.set()
        if self.mirror is not None:
            self.mirror.close()
        # The feed's socket first: with a CURVE allow-list it lives in the RPC server's private
        # context, whose termination would wait for it forever.
        if self.feed is not None:
            self.feed.close()
        self._rpc.close()
        if self._sweeper is not None:
            self._sweeper.join(5)

    def __enter__(self) -> RegistryServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _sweep_loop(self) -> None:
        warned = False
        while not self._stop.wait(self._sweep_interval):
            try:
                swept = self.store.sweep()
                live, total, entries = self.store.counts()
            except StoreUnavailable as e:
                if not warned:
                    log.warning("sweeper: %s (will keep retrying)", e)
                    warned = True
                continue
            except Exception:
                log.exception("sweeper failed")
                continue
            if warned:
                log.info("sweeper: store reachable again")
                warned = False
            if swept:
                self.metrics.swept.inc(swept)
            self.metrics.workers_live.set(live)
            self.metrics.workers_total.set(total)
            self.metrics.block_entries.set(entries)

    # -- handlers -----------------------------------------------------------------------

    def _guard(self, handler: Callable[..., Any]) -> Callable[..., Any]:
        """Count a store outage (the error itself still answers ERR StoreUnavailable)."""
        def guarded(*args: Any) -> Any:
            try:
                return handler(*args)
            except StoreUnavailable:
                self.metrics.errors.labels("store_unavailable").inc()
                raise
        return guarded

    def _check_endpoint(self, req: RegisterWorker) -> None:
        """Refuse (RegistryError) or flag an endpoint other hosts could not dial; see the module docstring."""
        verdict = endpoint_verdict(req.endpoint, self._rpc.endpoint)
        if verdict == "wildcard":
            self._refuse(req, f"worker {req.worker_id}: endpoint {req.endpoint} is a wildcard address no target "
                              f"can dial; the source must advertise a routable one (REMOTE_G2_SOURCE_ADVERTISE)")
        elif verdict == "loopback":
            self._refuse(req, f"worker {req.worker_id}: endpoint {req.endpoint} is a loopback address, and this "
                              f"registry ({self._rpc.endpoint}) is reached from other hosts: targets there could "
                              f"not dial it; bind or advertise a routable address (REMOTE_G2_SOURCE_BIND / "
                              f"REMOTE_G2_SOURCE_ADVERTISE)")
        elif verdict == "flagged":
            self.metrics.endpoint_checks.labels("flagged").inc()
            self._flag_log.warning(f"loopback:{req.worker_id}",
                                   "worker %s registered the loopback endpoint %s with a registry listening on "
                                   "every interface: only targets on its own host can reach it",
                                   req.worker_id, req.endpoint)

    def _refuse(self, req: RegisterWorker, message: str) -> None:
        self.metrics.endpoint_checks.labels("refused").inc()
        self._flag_log.warning(f"refused:{req.worker_id}", "refused a registration: %s", message)
        raise RegistryError(message)

    def _register_worker(self, req: RegisterWorker, ctx: CallContext) -> RegisterWorkerReply:
        if req.kind is not None:  # only this server's own KV-event ingest lists a worker it follows
            raise RegistryError(f"worker {req.worker_id}: a client registers a source (no kind), not {req.kind!r}")
        self._check_endpoint(req)
        reply = self.store.register_worker(req)
        self.publish(req)
        log.info("worker %s registered (epoch %d, %s, tp=%d%s)", req.worker_id, req.epoch, req.endpoint,
                 req.fingerprint.tp_size, ", new incarnation" if reply.new_incarnation else "")
        return reply

    def _heartbeat(self, req: Heartbeat, ctx: CallContext) -> HeartbeatReply:
        reply = self.store.heartbeat(req)
        if reply.status == "ok":
            self.publish(req)
        return reply

    def _events_batch(self, req: Events, ctx: CallContext) -> EventsReply:
        reply = self.store.apply_events(req)
        if reply.status == "ok":
            self.publish(req)
            self.metrics.events_ingested.labels("rpc").inc(reply.applied)
            with self._counter_lock:
                self._events += reply.applied
        elif reply.status == "resync_needed":
            self.metrics.resyncs.inc()
        return reply

    def _resync(self, req: Resync, ctx: CallContext) -> ResyncReply:
        reply = self.store.resync(req)
        if reply.status == "ok":
            self.publish(req)
            self.metrics.events_ingested.labels("resync").inc(len(req.hashes))
        return reply

    def _lookups_batch(self, calls: list[tuple[Lookup, CallContext]]) -> list[LookupReply] | ConvertedLookups:
        """Every lookup that queued up together, handed to the store in one go.

        A Redis store answers later (the batch is on the wire): the RPC layer
        keeps serving meanwhile and collects the answers through ``result()``.
        """
        requests, ties = [req for req, _ in calls], [next(self._rr) for _ in calls]
        # With no complete copy (still syncing, or retaking it) the store answers.
        replies = self.mirror.lookup_many(requests, ties) if self.mirror is not None else None
        if replies is not None:
            self.metrics.mirror_lookups.inc(len(replies))
            self._count_lookups(replies, calls)
            return replies
        started = self.store.start_lookups(requests, ties)
        if isinstance(started, list):
            self._count_lookups(started, calls)
            return started
        return ConvertedLookups(started, lambda replies: self._counted(replies, calls), errors=(StoreUnavailable,),
                                on_error=self._store_unavailable)

    def _counted(self, replies: list[LookupReply], calls: list[tuple[Lookup, CallContext]]) -> list[LookupReply]:
        self._count_lookups(replies, calls)
        return replies

    def _store_unavailable(self, e: BaseException) -> BaseException:
        self.metrics.errors.labels("store_unavailable").inc()
        return e

    def _count_lookups(self, replies: list[LookupReply], calls: list[tuple[Lookup, CallContext]]) -> None:
        now = time.perf_counter()
        hits = 0
        for reply, (_, ctx) in zip(replies, calls):
            self.metrics.lookup_latency.observe(now - ctx.received_at)
            self.metrics.lookup_reason(reply.reason).inc()
            if reply.reason == "ok":
                hits += 1
                self.metrics.matched_blocks.inc(reply.matched)
        self.metrics.lookups.inc(len(replies))
        self.metrics.lookup_hits.inc(hits)
        with self._counter_lock:
            self._lookups += len(replies)
            self._hits += hits

    def _who_has(self, req: WhoHas, ctx: CallContext) -> WhoHasReply:
        return WhoHasReply(self.store.who_has(req.hashes, include_dead=req.include_dead))

    def _worker_info(self, req: WorkerInfo, ctx: CallContext) -> WorkerInfoReply:
        return WorkerInfoReply(self.store.worker_info(req.worker_id))

    def _list_workers(self, req: ListWorkers, ctx: CallContext) -> ListWorkersReply:
        return ListWorkersReply(self.store.list_workers(include_dead=req.include_dead))

    def _stats(self, req: Stats, ctx: CallContext) -> StatsReply:
        live, total, entries = self.store.counts()
        with self._counter_lock:
            return StatsReply(store=self.store.name, workers_live=live, workers_total=total, block_entries=entries,
                              lookups=self._lookups, lookup_hits=self._hits, events_ingested=self._events,
                              uptime_s=time.monotonic() - self._t0,
                              mirror="off" if self.mirror is None else "ready" if self.mirror.ready else "syncing")

    def _drain_worker(self, req: DrainWorker, ctx: CallContext) -> DrainWorkerReply:
        reply = self.store.drain_worker(req.worker_id)
        if reply.existed:
            self.publish(req)
        log.info("worker %s drained by admin (%d blocks)", req.worker_id, reply.removed_blocks)
        return reply

    def _feed_info(self, req: FeedInfo, ctx: CallContext) -> FeedInfoReply:
        if self.feed is None:
            return FeedInfoReply("", "", 0, self.store.lease_ttl_ms)
        return FeedInfoReply(self.feed_endpoint, self.feed.instance, self.feed.seq, self.store.lease_ttl_ms)

    def _scan_worker(self, req: ScanWorker, ctx: CallContext) -> ScanWorkerReply:
        record, hashes, cursor = self.store.scan_worker(req.worker_id, req.cursor, req.count)
        return ScanWorkerReply(record, hashes, cursor)

    def publish(self, req: object) -> None:
        """Put a write the store accepted on the change feed (no-op without one)."""
        if self.feed is not None:
            self.feed.publish(req)
