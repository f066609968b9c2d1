"""An in-process copy of the registry that answers lookups from local memory.

A scheduler that asks the registry server pays a network round trip (and, on
Redis, a script) per lookup. A :class:`RegistryMirror` instead follows the
servers' change feeds (:mod:`.feed`) and keeps the whole block index in this
process, so a lookup is a walk over local sets — what an event-driven router
(Dynamo's KV router, for one) does, except that the copy is of the
fleet-wide registry, which every worker keeps current.

How it stays right
------------------
* **Start-up and every resync:** subscribe to each server's feed, wait until
  every feed has delivered a frame (the subscription is live), *then* take a
  snapshot — ``list_workers`` and ``scan_worker`` chunks — and finally replay
  everything the feeds delivered meanwhile. Replaying is safe because a write
  the snapshot already reflects is recognised and skipped: event batches by
  their sequence number, registrations and heartbeats by epoch.
* **Following:** each feed numbers its frames 1, 2, 3, … per server
  instance; a missing number (PUB dropped it), a server restart (new
  instance), a malformed frame, a feed silent for ``stale_after_s``, or a
  write the copy cannot apply the way the store did (it has drifted) each
  throws the copy away and takes a fresh snapshot. Meanwhile :meth:`lookup`
  raises :class:`~remote_g2.errors.MirrorNotReady`, and callers ask the
  server instead.
* **A server that dies or hangs** is noticed from the feed's connection
  (:mod:`remote_g2.rpc.connection_watch`): a killed server's connection is
  closed by its kernel at once, a hung one stops answering ZMTP heartbeats
  and is dropped after ``heartbeat_s``. Either throws the copy away and
  takes a fresh snapshot from the servers that answer, at once rather than
  after ``stale_after_s`` of silence (kept for a server whose libzmq still
  answers heartbeats but whose feed stopped): writes the lost server
  applied but never published are in the store, so the snapshot has them,
  and the other feeds are subscribed before it is taken, so nothing they
  publish across the switch is missed.
* **A server that does not answer** is left out of a snapshot as long as
  another one answers (the store holds every write, whichever server took
  it); one whose connection is known to be down is not even asked. The
  copy follows the others and asks the missing one again (every second once
  its connection is back up, else every few seconds), taking a fresh
  snapshot once it answers. Writes that go
  through a server the copy cannot reach are caught as above (sequence
  numbers, leases): lookups may miss blocks meanwhile, or name a block
  its worker has since dropped (the resolve then finds less), never a
  block its worker never stored.
* **Liveness** is judged locally: the copy renews a worker's lease when it
  sees the heartbeat, so a worker that stops heartbeating disappears from the
  mirror's lookups when its lease runs out, as on the server.

What it does not promise: a write is visible here a feed hop after the
server applied it (sub-millisecond on one host). A lookup is a hint either
way — the source pins blocks atomically on ``resolve`` and answers with what
it really has — so a moment's lag costs at most a shorter match, never wrong
bytes. The copy follows the servers it was given: point it at every server
that takes writes (a worker whose batches go through another server is
caught by its sequence numbers and resynced, but its heartbeats would be
missed).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import zmq

from remote_g2.rpc.connection_watch import ConnectionWatch, Liveness
from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.rpc.endpoint_list import endpoint_list
from remote_g2.errors import MirrorNotReady, ProtocolError, RegistryError, RemoteG2Error, TransportError
from remote_g2.protocol.messages import FeedTick, Lookup, LookupReply
from remote_g2.rpc.net_address import is_loopback, is_wildcard, split_tcp, with_host
from remote_g2.protocol.wire import decode_frame, decode_request_body

from .registry_client import RegistryClient
from .mirror_index import MirrorIndex

__all__ = ["RegistryMirror", "MirrorIndex", "MirrorStats", "feed_endpoint_from"]

log = logging.getLogger("remote_g2.registry.client.mirror")

_FEED_TYPES = frozenset({"register_worker", "heartbeat", "events", "resync", "drain_worker", "feed_tick"})
_RCVHWM = 1_000_000
_MAX_RETRY_S = 30.0
_PROBE_EVERY_S = 5.0     # how often a server left out of the copy is asked again (its connection not known up)
_PROBE_UP_EVERY_S = 1.0  # ... and once its connection is up again (it may be back)
_PROBE_TIMEOUT_S = 0.25  # short: the follower thread waits for it


@dataclass(frozen=True, slots=True)
class MirrorStats:
    """What a mirror has done; ``resyncs`` counts snapshots after the first, by reason."""

    ready: bool
    workers_live: int
    block_entries: int
    applied: int
    malformed: int
    snapshots: int
    resyncs: dict[str, int]
    last_snapshot_s: float


class _Resync(Exception):
    """The copy must be thrown away and retaken; ``reason`` is a metric label."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def feed_endpoint_from(registry: str, feed: str) -> str:
    """The feed endpoint to dial, given the one a server at ``registry`` reports (RegistryError: none usable).

    A feed bound to a wildcard (a server bound to ``0.0.0.0``) is reached at
    the host this mirror reaches the server at; one on loopback only from a
    mirror that reaches the server over loopback too.
    """
    if not feed:
        raise RegistryError(f"registry {registry} publishes no change feed (serve --feed-bind none)")
    if not feed.startswith("tcp://") or not registry.startswith("tcp://"):
        return feed  # ipc:// (same host) or a server reached another way: as reported
    _, feed_host, _ = split_tcp(feed)
    _, registry_host, _ = split_tcp(registry)
    if is_wildcard(feed_host):
        return with_host(feed, registry_host)
    if is_loopback(feed_host) and not is_loopback(registry_host) and not is_wildcard(registry_host):
        raise RegistryError(f"registry {registry} publishes its change feed on {feed}, a loopback address this "
                            f"host cannot reach: serve with --feed-bind (or --feed-advertise) on a routable address")
    return feed


class RegistryMirror:
    """Follow the registry servers at ``endpoints`` and answer lookups from memory.

    ``start()`` begins in the background; :meth:`wait_ready` blocks until the
    first snapshot is in. ``lookup`` has the server's contract (see
    :mod:`..stores.contract`) and raises :class:`MirrorNotReady` while no complete copy is
    held. Thread-safe: one thread follows the feeds, any thread may look up.
    """

    def __init__(self, endpoints: str | Sequence[str], *, timeout_s: float = 5.0,
                 curve: CurveClientConfig | None = None, scan_count: int = 16_384,
                 stale_after_s: float = 3.0, retry_s: float = 0.5, context: zmq.Context | None = None,
                 compat_key: str | None = None, heartbeat_s: float | None = None) -> None:
        """``compat_key``: hold only workers of that layout (``LayoutFingerprint.compat_key()``: a target's own),
        not the whole fleet; None: every worker (a server's mirror answers every layout). ``heartbeat_s``: a
        server whose connections stay silent that long is left (:class:`~remote_g2.rpc.connection_watch.Liveness`;
        None: ``REMOTE_G2_REGISTRY_HEARTBEAT_S``, else 1 s)."""
        self.compat_key = compat_key
        self.endpoints = endpoint_list(endpoints)  # one server, or several (comma-separated or a list); checked
        self._timeout_s = timeout_s
        self._curve = curve
        self._scan_count = scan_count
        self._stale_after_s = stale_after_s
        self._retry_s = retry_s
        self._ctx = context or zmq.Context.instance()
        self._index: MirrorIndex | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._waker = os.pipe()  # close() writes to it: the follower's poll returns at once, with no tick to wait
        os.set_blocking(self._waker[1], False)
        self._thread: threading.Thread | None = None
        self._rr = itertools.count()
        self._applied = self._malformed = self._snapshots = 0
        self._resyncs: dict[str, int] = {}
        self._last_snapshot_s = 0.0
        self._missing: list[RegistryClient] = []  # servers left out of the current copy (no answer)
        self._liveness = Liveness.from_env(heartbeat_s)
        self._watch: ConnectionWatch | None = None  # the feed socket's connection events (follower thread only)
        self._followed: set[str] = set()  # feed endpoints the current copy follows
        self._dialled: set[str] = set()  # every feed endpoint ever connected to
        self.last_error = ""

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> RegistryMirror:
        """Begin following in the background (once; a second call does nothing)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="registry-mirror", daemon=True)
            self._thread.start()
        return self

    def wait_ready(self, timeout_s: float) -> bool:
        """True once a complete copy is held (False if ``timeout_s`` passed first)."""
        return self._ready.wait(timeout_s)

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def close(self) -> None:
        self._stop.set()
        if self._waker is None:
            return
        try:
            os.write(self._waker[1], b"x")
        except OSError:  # (full: a wake is pending anyway)
            pass
        if self._thread is not None:
            self._thread.join(10)
            if self._thread.is_alive():
                return  # (its poll still holds the pipe: leave it open)
        for fd in self._waker:
            os.close(fd)
        self._waker = None

    def __enter__(self) -> RegistryMirror:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- reads ----------------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, requester: str | None = None, compat_key: str | None = None,
               want_all_holders: bool = False, tie_breaker: int | None = None) -> LookupReply:
        """The registry's prefix lookup, answered from this process's copy (ties: round-robin unless given).

        Raises :class:`MirrorNotReady` while no complete copy is held.
        """
        if not hashes:
            raise ValueError("lookup needs at least one hash")
        replies = self.lookup_many([Lookup(list(hashes), requester, compat_key, want_all_holders)],
                                   None if tie_breaker is None else [tie_breaker])
        if replies is None:
            raise MirrorNotReady(f"registry mirror of {', '.join(self.endpoints)} has no complete copy yet"
                                 + (f" ({self.last_error})" if self.last_error else ""))
        return replies[0]

    def lookup_many(self, requests: Sequence[Lookup],
                    tie_breakers: Sequence[int] | None = None) -> list[LookupReply] | None:
        """Answer ``requests`` from the copy as the store's ``lookup_many`` would; None while no complete
        copy is held (the caller asks the server instead). Ties are round-robin unless given."""
        index = self._index
        if index is None or not self._ready.is_set():
            return None
        ties = [next(self._rr) for _ in requests] if tie_breakers is None else tie_breakers
        return index.lookup_many(requests, ties)

    def held_prefixes(self, hashes: Sequence[bytes], compat_key: str) -> dict[str, int] | None:
        """:meth:`~..stores.contract.RegistryStore.held_prefixes` from the copy; None while no complete copy is held."""
        index = self._index
        if index is None or not self._ready.is_set():
            return None
        return index.held_prefixes(hashes, compat_key)

    def holds_any(self, block_hash: bytes) -> bool | None:
        """:meth:`~..stores.contract.RegistryStore.holds_any` from the copy; None while no complete copy is held."""
        index = self._index
        if index is None or not self._ready.is_set():
            return None
        return index.holds_any(block_hash)

    def stats(self) -> MirrorStats:
        index = self._index
        live, _, entries = index.counts() if index is not None else (0, 0, 0)
        return MirrorStats(self.ready, live, entries, self._applied, self._malformed, self._snapshots,
                           dict(self._resyncs), self._last_snapshot_s)

    # -- the follower thread ------------------------------------------------------------------

    def _run(self) -> None:
        clients = [RegistryClient(ep, timeout_s=self._timeout_s, curve=self._curve,
                                  heartbeat_s=self._liveness.heartbeat_s) for ep in self.endpoints]
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, _RCVHWM)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        if self._curve is not None:
            self._curve.apply(sub)
        self._liveness.apply(sub)
        self._watch = ConnectionWatch(sub)
        connected: set[str] = set()
        failures = 0
        try:
            while not self._stop.is_set():
                try:
                    last = self._snapshot(clients, sub, connected)
                    failures = 0
                    self._follow(sub, last)
                except _Resync as e:
                    self._ready.clear()
                    self._resyncs[e.reason] = self._resyncs.get(e.reason, 0) + 1
                    self.last_error = str(e)
                    log.warning("registry mirror: resync (%s)", e)
                except Exception as e:  # noqa: BLE001 - the copy must never stay "ready" behind a dead thread
                    self._ready.clear()
                    error = f"{type(e).__name__}: {e}"
                    # Back off while the registry stays away, and say so once, not every retry.
                    delay = min(self._retry_s * 2 ** min(failures, 6), _MAX_RETRY_S)
                    if error != self.last_error:
                        if isinstance(e, (RemoteG2Error, zmq.ZMQError)):
                            log.warning("registry mirror: %s; retrying (every %.1f s at most)", error, _MAX_RETRY_S)
                        else:
                            log.exception("registry mirror: unexpected error; retrying")
                    self.last_error = error
                    failures += 1
                    self._stop.wait(delay)
        finally:
            self._ready.clear()
            self._watch.close()
            sub.close(0)
            for c in clients:
                c.close()

    def _recv(self, sub: zmq.Socket, timeout_ms: int) -> tuple[str, int, Any] | None:
        """One feed frame as (instance, seq, write or FeedTick), or None when none came in time."""
        if not sub.poll(timeout_ms, zmq.POLLIN):
            return None
        parts = sub.recv_multipart(zmq.NOBLOCK)
        try:
            if len(parts) != 2 or len(parts[0]) != 16:
                raise ProtocolError(f"feed frame has {len(parts)} parts; expected [16-char instance, frame]")
            instance = parts[0].decode("ascii")
            frame = decode_frame(parts[1])
            if frame.type not in _FEED_TYPES:
                raise ProtocolError(f"{frame.type!r} does not belong on the change feed")
            _, msg = decode_request_body(frame)
        except (ProtocolError, UnicodeDecodeError) as e:
            self._malformed += 1
            raise _Resync("malformed", str(e)) from None
        seq = msg.seq if isinstance(msg, FeedTick) else frame.id
        return instance, seq, msg

    def _snapshot(self, clients: list[RegistryClient], sub: zmq.Socket, connected: set[str]) -> dict[str, int]:
        """Take a complete copy; return each feed instance's last sequence number seen."""
        self._ready.clear()
        infos, answering, self._missing = [], [], []
        for client in clients:
            several = len(clients) > 1
            try:
                if several and client.connection_state() == "down":
                    raise TransportError("its connection is down")
                info = client.feed_info(fail_fast=several)
            except TransportError as e:
                if not several:
                    raise
                log.warning("registry mirror: %s does not answer (%s); following the others", client.endpoint, e)
                self._missing.append(client)
                continue
            answering.append(client)
            infos.append(replace(info, endpoint=feed_endpoint_from(client.endpoint, info.endpoint)))
        if not answering:
            raise RegistryError(f"no registry server of {', '.join(self.endpoints)} answers")
        assert self._watch is not None
        for gone in connected - {info.endpoint for info in infos}:  # a restarted server's old feed port
            sub.disconnect(gone)
            connected.discard(gone)
            self._watch.forget(gone)
        for info in infos:
            if info.endpoint not in connected:
                sub.connect(info.endpoint)
                connected.add(info.endpoint)
        self._followed = set(connected)
        self._dialled |= connected
        # Frames that arrive from here on are kept and replayed over the snapshot.
        backlog: list[tuple[str, int, Any]] = []
        last: dict[str, int] = {}
        wanted = {info.instance for info in infos}
        deadline = time.monotonic() + max(self._timeout_s, self._stale_after_s)
        while not wanted <= last.keys():
            if self._stop.is_set() or time.monotonic() > deadline:
                raise RegistryError("no frame from the change feed(s) of "
                                    f"{', '.join(sorted(wanted - last.keys()))} in time")
            got = self._recv(sub, 100)
            if got is not None:
                self._check_seq(last, got, first_sight_ok=True)
                backlog.append(got)
        t0 = time.perf_counter()
        index = MirrorIndex(infos[0].lease_ttl_ms, self.compat_key)
        for worker in answering[0].list_workers():
            if index.follows(worker):
                self._copy_worker(answering[0], index, worker.worker_id)
            self._drain(sub, last, backlog)
        self._drain(sub, last, backlog)
        for _, _, msg in backlog:
            if isinstance(msg, FeedTick):
                continue
            if not index.replay(msg):
                raise _Resync("drift", f"{type(msg).__name__} for {msg.worker_id!r} did not apply over the snapshot")
            self._applied += 1
        self._watch.drain()  # what happened to the feeds' connections so far; _follow checks where they are now
        self._index = index
        self._snapshots += 1
        self._last_snapshot_s = time.perf_counter() - t0
        self.last_error = ""
        live, _, entries = index.counts()
        log.info("registry mirror: snapshot of %d workers, %d entries in %.2f s", live, entries,
                 self._last_snapshot_s)
        self._ready.set()
        return last

    def _copy_worker(self, client: RegistryClient, index: MirrorIndex, worker_id: str) -> None:
        for _ in range(3):  # a worker that re-registers mid-scan is scanned again
            reply = client.scan_worker(worker_id, b"", self._scan_count)
            if reply.worker is None:
                return
            index.install(reply.worker, reply.hashes)
            cursor, whole = reply.cursor, True
            while cursor:
                reply = client.scan_worker(worker_id, cursor, self._scan_count)
                if reply.worker is None or not index.extend(reply.worker, reply.hashes):
                    whole = False
                    break
                cursor = reply.cursor
            if whole:
                return
        raise _Resync("churn", f"worker {worker_id!r} kept changing incarnation during the snapshot")

    def _drain(self, sub: zmq.Socket, last: dict[str, int], backlog: list[tuple[str, int, Any]]) -> None:
        while (got := self._recv(sub, 0)) is not None:
            self._check_seq(last, got, first_sight_ok=False)
            backlog.append(got)

    @staticmethod
    def _check_seq(last: dict[str, int], got: tuple[str, int, Any], *, first_sight_ok: bool) -> None:
        """Check a frame's number against its feed's last one (:class:`_Resync` on a gap) and record it."""
        instance, seq, msg = got
        prev = last.get(instance)
        if prev is None:
            if not first_sight_ok:
                raise _Resync("new_instance", f"feed instance {instance} appeared (a server restarted?)")
        elif isinstance(msg, FeedTick):
            if seq != prev:
                raise _Resync("gap", f"feed {instance} ticked at {seq} after {prev}")
        elif seq != prev + 1:
            raise _Resync("gap", f"feed {instance} jumped from {prev} to {seq}")
        last[instance] = seq

    def _follow(self, sub: zmq.Socket, last: dict[str, int]) -> None:
        index = self._index
        assert index is not None
        heard = {instance: time.monotonic() for instance in last}
        next_sweep = time.monotonic() + 1.0
        next_probe = next_up_probe = time.monotonic() + _PROBE_UP_EVERY_S
        watch = self._watch
        assert watch is not None
        for endpoint in self._followed:  # a feed lost while the snapshot was taken
            if watch.state(endpoint) == "down":
                raise _Resync("server_lost", f"the connection to feed {endpoint} went down")
        poller = zmq.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(watch.socket, zmq.POLLIN)
        assert self._waker is not None
        poller.register(self._waker[0], zmq.POLLIN)
        while not self._stop.is_set():
            # Asleep until a frame, close(), or the next thing due (a sweep, a feed gone silent, a probe): not on
            # a fixed tick, whose every wake would take a core from an engine busy on all of them.
            due = min(next_sweep, min(heard.values(), default=next_sweep) + self._stale_after_s,
                      next_up_probe if self._missing else next_sweep)
            ready = dict(poller.poll(max(0, int((due - time.monotonic()) * 1000) + 1)))
            if watch.socket in ready:
                for endpoint, state in watch.drain():
                    # A feed followed, or one libzmq names in a form this copy never dialled (not one it left).
                    if state == "down" and (endpoint in self._followed or endpoint not in self._dialled):
                        raise _Resync("server_lost", f"the connection to feed {endpoint} was lost "
                                                     "(its server was killed, or stopped answering heartbeats)")
            got = self._recv(sub, 0) if sub in ready else None
            now = time.monotonic()
            if got is not None:
                self._check_seq(last, got, first_sight_ok=False)
                heard[got[0]] = now
                msg = got[2]
                if not isinstance(msg, FeedTick):
                    if not index.replay(msg):
                        raise _Resync("drift", f"{type(msg).__name__} for {msg.worker_id!r} did not apply")
                    self._applied += 1
            silent = [i for i, t in heard.items() if now - t > self._stale_after_s]
            if silent:
                raise _Resync("silent", f"no frame from feed {silent[0]} for {self._stale_after_s:.1f} s")
            if now >= next_sweep:
                index.sweep()
                next_sweep = now + 1.0
            if self._missing and now >= next_up_probe:
                next_up_probe = now + _PROBE_UP_EVERY_S
                every = now >= next_probe
                if every:
                    next_probe = now + _PROBE_EVERY_S
                for client in self._missing:
                    state = client.connection_state()
                    if state == "down" or (state != "up" and not every):
                        continue
                    try:
                        client.feed_info(timeout_s=_PROBE_TIMEOUT_S)
                    except TransportError:
                        continue
                    raise _Resync("server_back", f"{client.endpoint} answers again")
