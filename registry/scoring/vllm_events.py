"""Track vLLM workers from their KV-event ZMQ stream (``serve --vllm-kv-events``).

Wire format
-----------
vLLM's ``ZmqEventPublisher`` sends three-frame messages ``(topic, seq, payload)``:
``seq`` is an 8-byte big-endian counter starting at 0, ``payload`` a
msgspec-msgpack ``KVEventBatch`` — an array ``[ts, events, data_parallel_rank?]``.
Each event is a tagged struct: ``BlockStored`` (block_hashes, parent_block_hash,
token_ids, block_size, lora_id, medium, …), ``BlockRemoved`` (block_hashes,
medium, …) or ``AllBlocksCleared``. vLLM releases differ in how a tagged struct
is packed: array-like releases send ``["BlockStored", field1, field2, …]``,
others a map ``{"type": "BlockStored", "block_hashes": …}``; both are accepted.

Hashes
------
The registry keys a vLLM block by vLLM's own block hash, the bytes of
``request.block_hashes`` (32 bytes for the sha256 algorithms), which is what
the vLLM connector looks up. vLLM publishes those bytes only with
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``; by default it sends an int, the low
64 bits, which can never be turned back into the key the connector asks for.
Events carrying int hashes are therefore skipped and counted
(``errors{kind="vllm_int_hashes"}``), with one warning per stream.

Media
-----
Only the host tier (``medium == "CPU"``) is G2; other media are ignored unless
``all_media``. vLLM's CPU backend reports its device cache as ``"GPU"``, so
following one needs ``all_media``.

Connecting
----------
An endpoint is connected to (vLLM binds: a wildcard ``tcp://*:PORT`` or an
``ipc://`` path) or, written ``@tcp://HOST:PORT``, bound (vLLM connects: any
other ``tcp://`` endpoint). A socket monitor tells whether a ZMTP session with
the publisher is up; ZMTP heartbeats make a vanished host drop the session.

Worker records
--------------
Each subscription names the worker id its blocks belong to. Then, per stream:

* if the worker's own source registered it (a live record the subscriber did
  not create), the subscriber follows that record: it resyncs the blocks into
  it and applies events to it; the source keeps its lease;
* otherwise (a stock vLLM) the subscriber registers an *events-only* record
  (``kind="events-only"``) while the stream is up: endpoint
  ``events-only://WORKER_ID`` (nothing to dial) and a fingerprint that carries
  the model, with ``kv_layout="events-only"``, which no sharing
  worker's compat key matches, so a target's lookup never picks it while
  ``remote-g2 admin`` lists it and its blocks. Its epochs are small numbers,
  so a registration by the worker's own source (wall-clock epoch) always
  supersedes it. The subscriber heartbeats it only while a session with the
  publisher is up; after a whole lease with no session it unregisters it
  (``drain_worker``). When the stream comes back it registers again.

The subscriber keeps a mirror of the worker's hashes, so whenever the registry
needs a resync (new record, sequence gap, Redis back after an outage) it sends
the mirror. A publisher whose ``seq`` goes back (a restarted vLLM, whose cache
is empty) clears the mirror and the registry's copy. Malformed frames are
counted and skipped; a malformed event is refused alone and counted
(``kv_events_refused``); nothing stops the subscriber.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from remote_g2.errors import ConfigError, ProtocolError, RemoteG2Error
from remote_g2.protocol.messages import (
    BlockEvent,
    DrainWorker,
    Events,
    Heartbeat,
    LayoutFingerprint,
    RegisterWorker,
    Resync,
    WorkerRecord,
)
from remote_g2.rpc.server import normalize_bind_endpoint

from ..metrics import RegistryMetrics
from ..stores.contract import RegistryStore, resync_chunks
from .engine_caches import EngineCaches
from .vllm_subscriptions import Subscription, parse_subscriptions
from .vllm_event_decode import G2_MEDIUM, DecodedBatch, EngineEvent, decode_kv_event_batch

__all__ = [
    "VllmEventSubscriber",
    "Subscription",
    "DecodedBatch",
    "EngineEvent",
    "FeedState",
    "parse_subscriptions",
    "decode_kv_event_batch",
    "events_only_endpoint",
    "events_only_fingerprint",
    "G2_MEDIUM",
    "EVENTS_ONLY_LAYOUT",
]

log = logging.getLogger("remote_g2.registry.vllm")

EVENTS_ONLY_LAYOUT = "events-only"
_MAX_EVENTS = 4096  # per Events request (its wire limit, which the change feed applies)
_RECV_BURST = 64  # messages taken from one socket before looking at the others
_RETRY_S = 1.0  # a store call that failed is tried again after this
_FAILED = object()  # what a failed store call answers (see VllmEventSubscriber._store_call)


def events_only_endpoint(worker_id: str) -> str:
    """The endpoint of a record the subscriber registered for a stock vLLM: a marker, nothing to dial."""
    return f"{EVENTS_ONLY_LAYOUT}://{worker_id}"


def events_only_fingerprint(model: str) -> LayoutFingerprint:
    """A layout no sharing worker has: lookups with a compat key (every target's) never pick it."""
    return LayoutFingerprint(model_id=model, dtype="unknown", tokens_per_block=1, kv_layout=EVENTS_ONLY_LAYOUT,
                             num_layers=1, num_kv_heads=1, head_dim=1, tp_size=1)


# -- the subscriber ----------------------------------------------------------------------------------


class FeedState(enum.Enum):
    """Where a stream's blocks go; only :meth:`VllmEventSubscriber._enter` changes it."""

    UNSYNCED = "unsynced"  # into the mirror only: no record to apply to yet, or the registry must get a resync
    OWN = "own"  # into the events-only record this subscriber registered (and heartbeats while the stream is up)
    FOLLOWING = "following"  # into the record the worker's own source registered (its source keeps the lease)


@dataclass(eq=False)
class _Feed:
    sub: Subscription
    sock: zmq.Socket
    monitor: zmq.Socket
    endpoint: str  # as bound or connected (a bound port 0 resolved)
    down_since: float  # monotonic; when the last session with the publisher ended (or the feed started)
    state: FeedState = FeedState.UNSYNCED
    mirror: set[bytes] = field(default_factory=set)
    epoch: int = 0  # of the record being applied to (OWN, FOLLOWING)
    own_epoch: int = 0  # the last epoch this subscriber registered the worker with
    next_seq: int = 1
    last_vllm_seq: int | None = None
    connecting: set[int] = field(default_factory=set)  # fds whose ZMTP handshake is under way
    sessions: set[int] = field(default_factory=set)  # fds with a ZMTP session up
    due: float = 0.0  # monotonic; the next heartbeat (OWN), record check (FOLLOWING) or sync attempt (UNSYNCED)
    warned: set[str] = field(default_factory=set)  # one-time warnings given

    @property
    def up(self) -> bool:
        return bool(self.sessions)


class VllmEventSubscriber:
    """Subscribe to vLLM publishers and keep their workers' G2 blocks in ``store`` (one thread).

    ``start()`` binds or connects every subscription (a bind that fails raises
    :class:`~remote_g2.errors.ConfigError`) and starts the thread; ``close()``
    stops it. ``on_applied`` is told of every write the store accepted (the
    server's change feed).
    """

    def __init__(self, store: RegistryStore, subscriptions: Iterable[Subscription], *, all_media: bool = False,
                 metrics: RegistryMetrics | None = None, context: zmq.Context | None = None,
                 on_applied: Callable[[object], None] | None = None, engines: EngineCaches | None = None) -> None:
        self.store = store
        self.engines = engines  # every event, every medium, either hash form: what each engine holds (scoring)
        self._on_applied = on_applied or (lambda req: None)
        self.all_media = all_media
        self.metrics = metrics
        self._ctx = context or zmq.Context.instance()
        self._subs = list(subscriptions)
        self._feeds: list[_Feed] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.malformed, self.refused = 0, 0  # frames or batches skipped whole; single events refused
        self.int_hash_events = 0
        self.gaps = 0
        self.restarts = 0
        self.applied = 0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> VllmEventSubscriber:
        try:
            for sub in self._subs:
                self._feeds.append(self._open(sub))
        except BaseException:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the thread; an events-only record is left to lapse (nobody heartbeats it any more)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
            if self._thread.is_alive():
                return  # still using its sockets
        self._close_sockets()

    def _open(self, sub: Subscription) -> _Feed:
        sock = self._ctx.socket(zmq.SUB)
        sock.linger = 0
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        # ZMTP heartbeats: a publisher whose host vanished drops the session within a few intervals.
        ivl_ms = min(max(self.store.lease_ttl_ms // 5, 100), 2000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * ivl_ms)
        sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * ivl_ms)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED
                                          | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            if sub.bind:
                sock.bind(normalize_bind_endpoint(sub.endpoint))
                endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
            else:
                sock.connect(sub.endpoint)
                endpoint = sub.endpoint
        except zmq.ZMQError as e:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            how = "bind" if sub.bind else "connect to"
            raise ConfigError(f"--vllm-kv-events: cannot {how} {sub.endpoint} for {sub.worker_id}: {e}") from e
        log.info("%s %s for vLLM KV events of worker %s", "bound" if sub.bind else "connecting to", endpoint,
                 sub.worker_id)
        return _Feed(sub, sock, monitor, endpoint, down_since=time.monotonic())

    def _close_sockets(self) -> None:
        for feed in self._feeds:
            try:
                feed.sock.disable_monitor()
            except zmq.ZMQError:
                pass
            feed.monitor.close(0)
            feed.sock.close(0)
        self._feeds = []

    # -- what tests and operators ask ----------------------------------------------------------------

    def _feed(self, worker_id: str) -> _Feed:
        return next(f for f in self._feeds if f.sub.worker_id == worker_id)

    def mirror(self, worker_id: str) -> set[bytes]:
        """The G2 hashes the subscriber currently believes ``worker_id`` holds (a copy)."""
        return set(self._feed(worker_id).mirror)

    def endpoint(self, worker_id: str) -> str:
        """Where ``worker_id``'s subscription is bound (with the real port) or connecting."""
        return self._feed(worker_id).endpoint

    def state(self, worker_id: str) -> FeedState:
        return self._feed(worker_id).state

    def stream_up(self, worker_id: str) -> bool:
        """Whether a ZMTP session with ``worker_id``'s publisher is up."""
        return self._feed(worker_id).up

    # -- the thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        poller = zmq.Poller()
        by_socket: dict[zmq.Socket, tuple[_Feed, bool]] = {}
        for feed in self._feeds:
            for sock, is_monitor in ((feed.monitor, True), (feed.sock, False)):
                poller.register(sock, zmq.POLLIN)
                by_socket[sock] = (feed, is_monitor)
        while not self._stop.is_set():
            for sock, _ in poller.poll(100):
                feed, is_monitor = by_socket[sock]
                try:
                    if is_monitor:
                        self._on_monitor(feed)
                    else:
                        self._receive(feed)
                except Exception:
                    log.exception("vLLM events of %s: unexpected error (going on)", feed.sub.worker_id)
            now = time.monotonic()
            for feed in self._feeds:
                try:
                    self._tick(feed, now)
                except Exception:
                    log.exception("vLLM events of %s: unexpected error (going on)", feed.sub.worker_id)

    def _receive(self, feed: _Feed) -> None:
        for _ in range(_RECV_BURST):
            try:
                frames = feed.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._on_message(feed, frames)

    def _on_monitor(self, feed: _Feed) -> None:
        was_up = feed.up
        for _ in range(_RECV_BURST):
            try:
                ev = recv_monitor_message(feed.monitor, zmq.NOBLOCK)
            except zmq.Again:
                break
            kind, fd = ev["event"], ev["value"]
            if kind in (zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED):
                feed.connecting.add(fd)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                # The event carries no fd; handshakes finish one connection at a time in practice.
                feed.sessions |= feed.connecting
                feed.connecting.clear()
            elif kind == zmq.EVENT_DISCONNECTED:
                feed.connecting.discard(fd)
                feed.sessions.discard(fd)
        if feed.up and not was_up:
            log.info("vLLM KV-event stream of %s up (%s)", feed.sub.worker_id, feed.endpoint)
            if feed.state is FeedState.UNSYNCED:
                feed.due = 0.0  # register now, not at the next retry
        elif was_up and not feed.up:
            feed.down_since = time.monotonic()
            log.info("vLLM KV-event stream of %s down (%s)", feed.sub.worker_id, feed.endpoint)
        if len(feed.sessions) > 1:
            self._warn_once(feed, "several", "%d publishers are connected to %s for %s; their batches interleave "
                            "(give each vLLM its own endpoint and worker id)", len(feed.sessions), feed.endpoint,
                            feed.sub.worker_id)

    def _on_message(self, feed: _Feed, frames: list[bytes]) -> None:
        events: list[BlockEvent] = []
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ProtocolError("expected (topic, 8-byte seq, payload)")
            if self._publisher_restarted(feed, int.from_bytes(frames[1], "big")):
                events.append(BlockEvent("cleared"))
                if self.engines is not None:
                    self.engines.clear(feed.sub.worker_id)
            batch = decode_kv_event_batch(frames[2], all_media=self.all_media, engine=self.engines is not None)
        except ProtocolError as e:
            self.malformed += 1
            if self.metrics:
                self.metrics.errors.labels("vllm_malformed").inc()
            log.warning("vLLM event from %s skipped: %s", feed.endpoint, e)
        else:
            events += batch.events
            # (EngineCaches.apply never raises: an event it cannot apply is refused on its own)
            refused = batch.refused + (self.engines.apply(feed.sub.worker_id, batch.engine) if self.engines else 0)
            if refused:
                self._refused(feed, refused, batch.refusal or "the engine-cache view could not apply it")
            if batch.int_hash_events:
                self._int_hashes(feed, batch.int_hash_events)
            if batch.other_media and not batch.events and not self.all_media:
                self._warn_once(feed, "media", "vLLM events from %s for %s are of medium %s, not %s, and are "
                                "ignored; a CPU-backend vLLM reports its cache as GPU: pass --vllm-all-media",
                                feed.endpoint, feed.sub.worker_id, "/".join(sorted(map(str, batch.other_media))),
                                G2_MEDIUM, level=logging.INFO)
        for ev in events:
            if ev.kind == "stored":
                feed.mirror.update(ev.hashes)
            elif ev.kind == "removed":
                feed.mirror.difference_update(ev.hashes)
            else:
                feed.mirror.clear()
        if events and feed.state is not FeedState.UNSYNCED:
            self._apply(feed, events)

    def _publisher_restarted(self, feed: _Feed, seq: int) -> bool:
        """Track vLLM's batch numbers: a gap is logged, a step back means a new publisher (empty cache)."""
        last, feed.last_vllm_seq = feed.last_vllm_seq, seq
        if last is None or seq == last + 1:
            return False
        if seq <= last:
            self.restarts += 1
            log.warning("vLLM events from %s: sequence went back %d -> %d: publisher restarted; dropping the "
                        "blocks of %s", feed.endpoint, last, seq, feed.sub.worker_id)
            return True
        # Missed batches cannot be recovered from a PUB stream; the mirror may
        # hold stale hashes, which at worst costs a failed resolve.
        self.gaps += 1
        log.warning("vLLM events from %s: gap %d -> %d", feed.endpoint, last, seq)
        return False

    def _refused(self, feed: _Feed, n: int, why: str) -> None:  # (the rest of their batch went on)
        self.refused += n
        if self.metrics:
            self.metrics.kv_events_refused.inc(n)
        log.warning("vLLM events from %s for %s: %d refused, the rest of the batch kept (first: %s)",
                    feed.endpoint, feed.sub.worker_id, n, why)

    def _int_hashes(self, feed: _Feed, n: int) -> None:
        self.int_hash_events += n
        if self.metrics:
            self.metrics.errors.labels("vllm_int_hashes").inc(n)
        self._warn_once(feed, "int", "vLLM at %s publishes block hashes as 64-bit ints "
                        "(VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1, vLLM's default); their events are skipped, so "
                        "worker %s shows no blocks. Set VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0 in vLLM's "
                        "environment: the registry keys blocks by vLLM's full block hash, which the connector "
                        "looks up and which the int (its low 64 bits) cannot be turned back into; a 64-bit key "
                        "would also collide (a few per cent chance of some collision at 1e9 blocks). The scoring "
                        "API (serve --score-bind) still scores it from them, for routing only",
                        feed.endpoint, feed.sub.worker_id)

    def _warn_once(self, feed: _Feed, key: str, msg: str, *args: object, level: int = logging.WARNING) -> None:
        if key not in feed.warned:
            feed.warned.add(key)
            log.log(level, msg, *args)

    # -- the registry side: one place changes a feed's state ---------------------------------------------

    def _enter(self, feed: _Feed, state: FeedState, why: str, *, epoch: int = 0, next_seq: int = 1,
               due: float = 0.0) -> None:
        if state is not feed.state:
            log.info("vLLM worker %s: %s -> %s (%s)", feed.sub.worker_id, feed.state.value, state.value, why)
        feed.state, feed.epoch, feed.next_seq, feed.due = state, epoch, next_seq, due

    def _tick(self, feed: _Feed, now: float) -> None:
        """Heartbeat, check or register, whichever is due for this stream."""
        lease_s = self.store.lease_ttl_ms / 1000
        if feed.state is FeedState.OWN and not feed.up:
            if now - feed.down_since >= lease_s:
                self._unregister(feed)
            return  # no heartbeat without a session: the lease runs out with the stream
        if now < feed.due:
            return
        if feed.state is FeedState.OWN:
            self._heartbeat(feed, now, lease_s)
        elif feed.state is FeedState.FOLLOWING:
            self._check_followed(feed, now, lease_s)
        else:
            self._sync(feed, now, lease_s)

    def _store_call(self, feed: _Feed, what: str, call: Callable[[], Any]) -> Any:
        """Run one store call; a store error is logged and answered :data:`_FAILED` (the caller retries later)."""
        try:
            return call()
        except RemoteG2Error as e:
            log.warning("vLLM worker %s: %s failed (%s: %s); will retry", feed.sub.worker_id, what,
                        type(e).__name__, e)
            return _FAILED

    def _heartbeat(self, feed: _Feed, now: float, lease_s: float) -> None:
        req = Heartbeat(feed.sub.worker_id, feed.epoch)
        reply = self._store_call(feed, "heartbeat", lambda: self.store.heartbeat(req))
        if reply is _FAILED:
            feed.due = now + min(_RETRY_S, lease_s / 3)
        elif reply.status == "ok":
            self._on_applied(req)
            feed.due = now + lease_s / 3
        else:
            self._enter(feed, FeedState.UNSYNCED, "heartbeat answered unknown_worker")

    def _check_followed(self, feed: _Feed, now: float, lease_s: float) -> None:
        rec = self._store_call(feed, "worker_info", lambda: self.store.worker_info(feed.sub.worker_id))
        if rec is not _FAILED and (rec is None or not rec.live or rec.epoch != feed.epoch):
            self._enter(feed, FeedState.UNSYNCED, "its record lapsed or was replaced")
        else:
            feed.due = now + lease_s / 3

    def _unregister(self, feed: _Feed) -> None:
        """No session for a whole lease: the stock worker is gone; drop its record if it is still ours."""
        wid = feed.sub.worker_id
        if self.engines is not None:
            self.engines.clear(wid)
        rec = self._store_call(feed, "worker_info", lambda: self.store.worker_info(wid))
        if rec is not None and rec is not _FAILED and self._is_own(feed, rec) and rec.epoch == feed.epoch:
            try:
                reply = self.store.drain_worker(wid)
            except NotImplementedError:
                reply = None  # the lease lapses by itself
            except RemoteG2Error as e:
                log.warning("vLLM worker %s: unregistering failed (%s); its lease lapses", wid, e)
                reply = None
            if reply is not None and reply.existed:
                self._on_applied(DrainWorker(wid))
        self._enter(feed, FeedState.UNSYNCED, f"no vLLM KV-event stream for {self.store.lease_ttl_ms} ms: gone")

    def _is_own(self, feed: _Feed, rec: WorkerRecord) -> bool:
        return rec.kind == "events-only" and rec.endpoint == events_only_endpoint(feed.sub.worker_id)

    def _sync(self, feed: _Feed, now: float, lease_s: float) -> None:
        """Find or make the record this stream's blocks go to, and resync the mirror into it."""
        wid = feed.sub.worker_id
        feed.due = now + _RETRY_S
        rec = self._store_call(feed, "worker_info", lambda: self.store.worker_info(wid))
        if rec is _FAILED:
            return
        if rec is not None and rec.live and not self._is_own(feed, rec):
            if self._resync(feed, rec.epoch, rec.last_seq + 1):
                self._enter(feed, FeedState.FOLLOWING, f"following the record of its own source at {rec.endpoint}",
                            epoch=rec.epoch, next_seq=rec.last_seq + 1, due=now + lease_s / 3)
            return
        if not feed.up:
            return  # a stock worker is listed only while its stream is up
        # Small epochs: a registration by the worker's own source (wall-clock ns) always wins.
        epoch = max(feed.own_epoch, rec.epoch if rec is not None and self._is_own(feed, rec) else 0) + 1
        req = RegisterWorker(wid, events_only_endpoint(wid), events_only_fingerprint(feed.sub.model or wid), epoch,
                             kind="events-only")
        reply = self._store_call(feed, "registering", lambda: self.store.register_worker(req))
        if reply is _FAILED:
            return
        feed.own_epoch = epoch
        self._on_applied(req)
        log.info("vLLM worker %s registered from its KV-event stream (events only, epoch %d)", wid, epoch)
        if self._resync(feed, epoch, reply.next_seq):
            self._enter(feed, FeedState.OWN, "stream up, no record of its own source", epoch=epoch,
                        next_seq=reply.next_seq, due=now + reply.lease_ttl_ms / 3000)

    def _resync(self, feed: _Feed, epoch: int, seq: int) -> bool:
        hashes = list(feed.mirror)
        for chunk, first, last in resync_chunks(hashes):
            req = Resync(feed.sub.worker_id, epoch, seq, list(chunk), first, last)
            reply = self._store_call(feed, "resync", lambda: self.store.resync(req))
            if reply is _FAILED or reply.status != "ok":
                return False
            self._on_applied(req)
        if self.metrics:
            self.metrics.events_ingested.labels("resync").inc(len(hashes))
        log.info("vLLM worker %s synced from its KV events (%d blocks)", feed.sub.worker_id, len(hashes))
        return True

    def _apply(self, feed: _Feed, events: list[BlockEvent]) -> None:
        for i in range(0, len(events), _MAX_EVENTS):
            req = Events(feed.sub.worker_id, feed.epoch, feed.next_seq, events[i:i + _MAX_EVENTS])
            reply = self._store_call(feed, "applying events", lambda: self.store.apply_events(req))
            if reply is _FAILED:
                self._enter(feed, FeedState.UNSYNCED, "applying events failed")
                return
            if reply.status != "ok":
                # The mirror already holds these events; the resync sends them.
                self._enter(feed, FeedState.UNSYNCED, f"events answered {reply.status}")
                return
            self._on_applied(req)
            feed.next_seq = reply.expected_seq
            self.applied += reply.applied
            if self.metrics:
                self.metrics.events_ingested.labels("vllm").inc(reply.applied)
