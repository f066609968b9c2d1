"""SourcePublisher: keeps the registry's view of one worker's G2 pool current.

The engine (or the source service) calls :meth:`SourcePublisher.stored`,
:meth:`~SourcePublisher.removed` and :meth:`~SourcePublisher.cleared` from any
thread; they only append to a queue. One background thread:

* registers the worker (epoch = wall-clock ns, so a restart always wins);
* sends queued events in batches (``flush_interval_s`` after the first of
  a batch, or once ``max_batch_hashes`` are waiting) with consecutive
  sequence numbers, and sleeps while nothing is queued; with
  ``min_batch_interval_s``, batches go at most that often: under a steady
  stream of events each batch gathers for that long, while the first event
  after a quiet spell still goes ``flush_interval_s`` after it (each batch
  wakes this thread, the registry server and every mirror of the feed);
* heartbeats every ``lease_ttl / 3`` with the current ``load()``;
* on ``resync_needed`` (an event batch's answer, or a heartbeat's when the
  store changed hands) sends a full snapshot from ``snapshot()``; on
  ``unknown_worker`` (lease lapsed, drained) registers with a new epoch first.

With a failover list, a server that dies or hangs is left by the client
(:mod:`.registry_client`) as soon as its connection is lost or stops answering
heartbeats; the batch in flight goes to the next server unchanged, and its
sequence number keeps it from being applied twice (a batch the lost server
applied is answered ``ok``) or lost. A registry that does not answer at all
costs nothing but delay: the batch is kept and retried with back-off; if the
backlog grows past ``max_backlog_hashes`` it is dropped and a resync is
scheduled instead, so memory stays bounded.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from remote_g2.errors import RegistryError, StaleEpoch, TransportError
from remote_g2.protocol.messages import BlockEvent, LayoutFingerprint

from ..stores.contract import resync_chunks
from .registry_client import RegistryClient

__all__ = ["SourcePublisher"]

log = logging.getLogger("remote_g2.registry.client.publisher")


class SourcePublisher:
    """Publishes one worker's block events to the registry; see the module docstring."""

    def __init__(
        self,
        client: RegistryClient,
        *,
        worker_id: str,
        endpoint: str,
        fingerprint: LayoutFingerprint,
        snapshot: Callable[[], Iterable[bytes]],
        load: Callable[[], int] | None = None,
        flush_interval_s: float = 0.05,
        min_batch_interval_s: float = 0.0,
        max_batch_hashes: int = 8192,
        max_backlog_hashes: int = 1_000_000,
        heartbeat_interval_s: float | None = None,
    ) -> None:
        self.client = client
        self.worker_id = worker_id
        self.endpoint = endpoint
        self.fingerprint = fingerprint
        self._snapshot = snapshot
        self._load = load or (lambda: 0)
        self._flush_interval = flush_interval_s
        self._min_batch_interval = min_batch_interval_s
        self._last_batch = -float("inf")  # (monotonic) when the last batch was sent
        self._max_batch = max_batch_hashes
        self._max_backlog = max_backlog_hashes
        self._hb_interval = heartbeat_interval_s
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queue: deque[BlockEvent] = deque()
        self._queued_hashes = 0
        self._need_resync = False
        self._idle = threading.Condition(self._lock)
        self._in_flight = False
        self.epoch = 0
        self.next_seq = 1
        self._lease_ttl_s = 10.0  # replaced by the registry's answer on registration
        self.registered = False
        # Counters, for logs and tests.
        self.batches_sent = 0
        self.resyncs = 0
        self.registrations = 0
        self._thread: threading.Thread | None = None

    # -- engine-facing, any thread ------------------------------------------------------

    def stored(self, hashes: Sequence[bytes], parent: bytes | None = None) -> None:
        if hashes:
            self._enqueue(BlockEvent("stored", list(hashes), parent))

    def removed(self, hashes: Sequence[bytes]) -> None:
        if hashes:
            self._enqueue(BlockEvent("removed", list(hashes)))

    def cleared(self) -> None:
        self._enqueue(BlockEvent("cleared"))

    def request_resync(self) -> None:
        """Send a full snapshot at the next opportunity (e.g. after the engine reloaded its pool)."""
        with self._lock:
            self._need_resync = True
        self._wake.set()

    def _enqueue(self, event: BlockEvent) -> None:
        with self._lock:
            first = not self._queue
            self._queue.append(event)
            self._queued_hashes += len(event.hashes)
            if self._queued_hashes > self._max_backlog:
                # The registry has been away too long: forget the backlog, resync later.
                self._queue.clear()
                self._queued_hashes = 0
                self._need_resync = True
            full = self._queued_hashes >= self._max_batch
        if full or first:  # (the first wakes an idle thread; it then waits the flush interval for more)
            self._wake.set()

    @property
    def backlog_hashes(self) -> int:
        """Hashes queued and not yet sent (an engine may slow down while it is large; past
        ``max_backlog_hashes`` the backlog is dropped for a resync)."""
        return self._queued_hashes

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> SourcePublisher:
        """Start the background thread; registration happens there (and is retried)."""
        self._thread = threading.Thread(target=self._run, name=f"publisher-{self.worker_id}", daemon=True)
        self._thread.start()
        return self

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything queued so far has been accepted by the registry; False on timeout."""
        deadline = time.monotonic() + timeout_s
        self._wake.set()
        with self._lock:
            while self._queue or self._in_flight or self._need_resync or not self.registered:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(min(left, 0.05))
                self._wake.set()
            return True

    def close(self, flush_timeout_s: float = 2.0) -> None:
        """Flush what is queued (bounded wait) and stop the thread."""
        if self._thread is None:
            return
        if self._thread.is_alive():
            self.flush(flush_timeout_s)
        self._stop.set()
        self._wake.set()
        self._thread.join(5)
        self._thread = None

    # -- background thread ---------------------------------------------------------------

    def _run(self) -> None:
        backoff = 0.05
        next_hb = 0.0
        while not self._stop.is_set():
            try:
                if not self.registered:
                    self._register()
                    next_hb = time.monotonic() + self._heartbeat_interval()
                if time.monotonic() >= next_hb:
                    self._heartbeat()
                    next_hb = time.monotonic() + self._heartbeat_interval()
                with self._lock:
                    resync = self._need_resync
                if resync:
                    self._resync()
                self._send_batch()
                backoff = 0.05
            except (TransportError, RegistryError) as e:
                if isinstance(e, StaleEpoch):
                    self.registered = False
                log.warning("publisher %s: %s; retrying in %.2fs", self.worker_id, e, backoff)
                self._stop.wait(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            with self._lock:
                idle = not self._queue and not self._need_resync
                if idle:
                    self._idle.notify_all()
            if idle:
                # Nothing to send: asleep until the next heartbeat or the first event, not every flush interval
                # (each wake takes a core from an engine whose forward keeps every core busy).
                self._wake.wait(max(0.0, next_hb - time.monotonic()))
                self._wake.clear()
                with self._lock:
                    batching = bool(self._queue) and self._queued_hashes < self._max_batch
                if not batching or self._stop.is_set():
                    continue
            with self._lock:
                full = self._queued_hashes >= self._max_batch
            if not full:
                # The batch window: events arriving meanwhile go together (a full batch or flush() ends it early).
                self._wake.wait(max(self._flush_interval,
                                    self._last_batch + self._min_batch_interval - time.monotonic()))
            self._wake.clear()

    def _heartbeat_interval(self) -> float:
        return self._hb_interval if self._hb_interval is not None else self._lease_ttl_s / 3

    def _register(self) -> None:
        epoch = max(time.time_ns(), self.epoch + 1)
        reply = self.client.register_worker(self.worker_id, self.endpoint, self.fingerprint, epoch)
        self.epoch = epoch
        self._lease_ttl_s = reply.lease_ttl_ms / 1000
        self.next_seq = reply.next_seq
        self.registrations += 1
        with self._lock:
            # A fresh incarnation holds nothing: the snapshot covers whatever was queued.
            self._need_resync = True
            self._queue.clear()
            self._queued_hashes = 0
        self.registered = True
        log.info("publisher %s registered (epoch %d)", self.worker_id, epoch)

    def _heartbeat(self) -> None:
        status = self.client.heartbeat(self.worker_id, self.epoch, self._load()).status
        if status == "resync_needed":  # still registered; the store may have lost some of our blocks
            log.warning("publisher %s: the registry asks for a resync (its store changed hands)", self.worker_id)
            with self._lock:
                self._need_resync = True
            self._wake.set()
        elif status != "ok":
            log.warning("publisher %s: registry forgot us; registering again", self.worker_id)
            self.registered = False
            self._register()

    def _resync(self) -> None:
        with self._lock:
            # Events queued before the snapshot are contained in it.
            self._queue.clear()
            self._queued_hashes = 0
            self._need_resync = False
            self._in_flight = True
        try:
            hashes = list(self._snapshot())
            for chunk, first, last in resync_chunks(hashes):
                reply = self.client.resync(self.worker_id, self.epoch, self.next_seq, chunk, first=first, last=last)
                if reply.status == "unknown_worker":
                    self.registered = False
                    self._register()
                    return
            self.resyncs += 1
        except BaseException:
            with self._lock:
                self._need_resync = True
            raise
        finally:
            with self._lock:
                self._in_flight = False

    def _send_batch(self) -> None:
        with self._lock:
            if not self._queue:
                return
            batch: list[BlockEvent] = []
            n = 0
            while self._queue and (n < self._max_batch or not batch):
                ev = self._queue.popleft()
                batch.append(ev)
                n += len(ev.hashes)
            self._queued_hashes -= n
            self._in_flight = True
            self._last_batch = time.monotonic()
        try:
            reply = self.client.events(self.worker_id, self.epoch, self.next_seq, batch)
        except BaseException:
            with self._lock:  # keep order: the batch goes back to the front
                self._queue.extendleft(reversed(batch))
                self._queued_hashes += n
                self._in_flight = False
            raise
        # The reply's consequence is recorded in the same locked step that clears _in_flight, so a
        # concurrent flush() never sees "nothing in flight, nothing pending" for a rejected batch.
        with self._lock:
            self._in_flight = False
            if reply.status == "ok":
                self.next_seq = reply.expected_seq
                self.batches_sent += 1
            elif reply.status == "resync_needed":
                self.next_seq = reply.expected_seq
                self._need_resync = True
            else:
                self.registered = False
        if reply.status != "ok":
            self._wake.set()
