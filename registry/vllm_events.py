"""Track stock vLLM workers from their KV-event ZMQ PUB stream.

vLLM's ``ZmqEventPublisher`` sends three-frame messages ``(topic, seq, payload)``:
``seq`` is an 8-byte big-endian counter, ``payload`` a msgspec-msgpack
``KVEventBatch`` — an array ``[ts, events, data_parallel_rank?]``. Each event is
a tagged struct: ``BlockStored`` (block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, …), ``BlockRemoved`` (block_hashes, medium, …) or
``AllBlocksCleared``. vLLM releases differ in how a tagged struct is packed:
array-like releases send ``["BlockStored", field1, field2, …]``, others a map
``{"type": "BlockStored", "block_hashes": …}``; both are accepted. A block hash
is bytes (SHA-256 based, 32 bytes) or, in older releases, a 64-bit int, which
becomes 8 bytes big-endian like every u64 hash here.

Only the host tier (``medium == "CPU"``) is G2; other media are ignored unless
``all_media``. Each publisher is mapped to a worker id whose record (endpoint,
layout) comes from that worker's own registration (its source service
registers it with event publishing off). The subscriber keeps a mirror of the
worker's G2 hashes, so whenever the registry needs a resync (new incarnation,
sequence gap, Redis back after an outage) it sends the mirror.

Malformed frames are counted and skipped; they never stop the subscriber.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from remote_g2.errors import ConfigError, ProtocolError, RemoteG2Error
from remote_g2.messages import BlockEvent, Events, Resync

from .metrics import RegistryMetrics
from .publisher import resync_chunks
from .store import RegistryStore

__all__ = ["VllmEventSubscriber", "Subscription", "parse_subscriptions", "decode_kv_event_batch", "G2_MEDIUM"]

log = logging.getLogger("remote_g2.registry.vllm")

G2_MEDIUM = "CPU"
_MAX_PAYLOAD = 64 * 1024 * 1024
# Field order of the array-like encoding (vllm/distributed/kv_events.py).
_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium")
_REMOVED_FIELDS = ("block_hashes", "medium")


@dataclass(frozen=True)
class Subscription:
    """One vLLM publisher endpoint and the worker id its blocks belong to."""

    endpoint: str
    worker_id: str


def parse_subscriptions(text: str) -> list[Subscription]:
    """Parse ``ENDPOINT=WORKER_ID[,…]`` (the ``--vllm-kv-events`` flag)."""
    subs = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        endpoint, sep, worker_id = item.partition("=")
        if not sep or not endpoint.startswith(("tcp://", "ipc://")) or not worker_id:
            raise ConfigError(f"--vllm-kv-events entry {item!r} is not ENDPOINT=WORKER_ID (tcp://host:port=worker)")
        subs.append(Subscription(endpoint, worker_id))
    if not subs:
        raise ConfigError("--vllm-kv-events lists no publisher")
    return subs


def _hash(value: Any) -> bytes:
    if type(value) is bytes and 1 <= len(value) <= 32:
        return value
    if type(value) is int and -(2**63) <= value < 2**64:
        return (value & 0xFFFF_FFFF_FFFF_FFFF).to_bytes(8, "big")
    raise ProtocolError(f"block hash must be 1..32 bytes or a 64-bit int, got {type(value).__name__}")


def _fields(raw: Any, names: Sequence[str]) -> tuple[str, dict[str, Any]]:
    if type(raw) is list and raw and type(raw[0]) is str:
        return raw[0], dict(zip(names, raw[1:]))
    if type(raw) is dict and type(raw.get("type")) is str:
        return raw["type"], raw
    raise ProtocolError("event is neither a tagged array nor a tagged map")


def decode_kv_event_batch(payload: bytes, *, all_media: bool = False) -> list[BlockEvent]:
    """Decode one vLLM ``KVEventBatch`` into block events for the G2 tier (strict)."""
    if len(payload) > _MAX_PAYLOAD:
        raise ProtocolError(f"event batch of {len(payload)} bytes exceeds {_MAX_PAYLOAD}")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_ext_len=0)
    except Exception as e:
        raise ProtocolError(f"event batch is not valid msgpack: {type(e).__name__}") from None
    if type(batch) is not list or len(batch) < 2 or type(batch[1]) is not list:
        raise ProtocolError("KVEventBatch must be an array [ts, events, ...]")
    out: list[BlockEvent] = []
    for raw in batch[1]:
        tag = raw[0] if type(raw) is list and raw else raw.get("type") if type(raw) is dict else None
        if tag == "AllBlocksCleared":
            out.append(BlockEvent("cleared"))
            continue
        names = _STORED_FIELDS if tag == "BlockStored" else _REMOVED_FIELDS if tag == "BlockRemoved" else None
        if names is None:
            raise ProtocolError(f"unknown KV event type {tag!r:.40}")
        _, f = _fields(raw, names)
        medium = f.get("medium")
        if medium is not None and type(medium) is not str:
            raise ProtocolError("medium must be a string or nil")
        if not all_media and medium != G2_MEDIUM:
            continue
        hashes = f.get("block_hashes")
        if type(hashes) is not list:
            raise ProtocolError("block_hashes must be an array")
        converted = [_hash(h) for h in hashes]
        if tag == "BlockStored":
            parent = f.get("parent_block_hash")
            out.append(BlockEvent("stored", converted, None if parent is None else _hash(parent)))
        else:
            out.append(BlockEvent("removed", converted))
    return out


@dataclass
class _Feed:
    sub: Subscription
    mirror: set[bytes] = field(default_factory=set)
    epoch: int | None = None
    next_seq: int = 1
    synced: bool = False
    last_vllm_seq: int | None = None


class VllmEventSubscriber:
    """Subscribe to vLLM publishers and apply their G2 events to ``store`` (one thread)."""

    def __init__(self, store: RegistryStore, subscriptions: Iterable[Subscription], *, all_media: bool = False,
                 metrics: RegistryMetrics | None = None, context: zmq.Context | None = None,
                 on_applied: Callable[[object], None] | None = None) -> None:
        self.store = store
        # Told of every write the store accepted (the server's change feed).
        self._on_applied = on_applied or (lambda req: None)
        self.all_media = all_media
        self.metrics = metrics
        self._ctx = context or zmq.Context.instance()
        self._feeds = [_Feed(s) for s in subscriptions]
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.malformed = 0
        self.gaps = 0
        self.applied = 0

    def start(self) -> VllmEventSubscriber:
        self._thread = threading.Thread(target=self._run, name="vllm-kv-events", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def mirror(self, worker_id: str) -> set[bytes]:
        """The G2 hashes the subscriber currently believes ``worker_id`` holds (a copy)."""
        return next(set(f.mirror) for f in self._feeds if f.sub.worker_id == worker_id)

    def _run(self) -> None:
        poller = zmq.Poller()
        sockets = {}
        for feed in self._feeds:
            sock = self._ctx.socket(zmq.SUB)
            sock.linger = 0
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(feed.sub.endpoint)
            poller.register(sock, zmq.POLLIN)
            sockets[sock] = feed
            log.info("subscribed to vLLM KV events at %s as worker %s", feed.sub.endpoint, feed.sub.worker_id)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(200):
                    for _ in range(64):
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._on_message(sockets[sock], frames)
                for feed in self._feeds:
                    if not feed.synced:
                        self._sync(feed)
        finally:
            for sock in sockets:
                sock.close(0)

    def _on_message(self, feed: _Feed, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ProtocolError("expected (topic, 8-byte seq, payload)")
            self._check_seq(feed, int.from_bytes(frames[1], "big"))
            events = decode_kv_event_batch(frames[2], all_media=self.all_media)
        except ProtocolError as e:
            self.malformed += 1
            if self.metrics:
                self.metrics.errors.labels("vllm_malformed").inc()
            log.warning("vLLM event from %s skipped: %s", feed.sub.endpoint, e)
            return
        for ev in events:
            if ev.kind == "stored":
                feed.mirror.update(ev.hashes)
            elif ev.kind == "removed":
                feed.mirror.difference_update(ev.hashes)
            else:
                feed.mirror.clear()
        if events and feed.synced:
            self._apply(feed, events)

    def _check_seq(self, feed: _Feed, seq: int) -> None:
        if feed.last_vllm_seq is not None and seq != feed.last_vllm_seq + 1:
            # Missed batches cannot be recovered from a PUB stream; the mirror may
            # hold stale hashes, which at worst costs a failed resolve.
            self.gaps += 1
            log.warning("vLLM events from %s: gap %d -> %d", feed.sub.endpoint, feed.last_vllm_seq, seq)
        feed.last_vllm_seq = seq

    def _apply(self, feed: _Feed, events: list[BlockEvent]) -> None:
        assert feed.epoch is not None
        req = Events(feed.sub.worker_id, feed.epoch, feed.next_seq, events)
        try:
            reply = self.store.apply_events(req)
        except RemoteG2Error as e:
            log.warning("vLLM events for %s not applied (%s); will resync", feed.sub.worker_id, e)
            feed.synced = False
            return
        if reply.status == "ok":
            self._on_applied(req)
            feed.next_seq = reply.expected_seq
            self.applied += reply.applied
            if self.metrics:
                self.metrics.events_ingested.labels("vllm").inc(reply.applied)
        else:
            feed.synced = False  # the mirror already holds these events; _sync sends it

    def _sync(self, feed: _Feed) -> None:
        """Send the mirror as a resync once the worker is registered and live."""
        try:
            rec = self.store.worker_info(feed.sub.worker_id)
            if rec is None or not rec.live:
                return
            hashes = list(feed.mirror)
            seq = rec.last_seq + 1
            for chunk, first, last in resync_chunks(hashes):
                req = Resync(feed.sub.worker_id, rec.epoch, seq, list(chunk), first, last)
                reply = self.store.resync(req)
                if reply.status != "ok":
                    return
                self._on_applied(req)
        except RemoteG2Error as e:
            log.debug("resync of %s deferred: %s", feed.sub.worker_id, e)
            return
        feed.epoch, feed.next_seq, feed.synced = rec.epoch, seq, True
        log.info("worker %s synced from vLLM events (%d blocks)", feed.sub.worker_id, len(hashes))
