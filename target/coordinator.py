"""The leader's coordinator: one thread, one event loop, every load in flight, the one place that decides.

Everything that happens to a load arrives here as an event on this thread —
the engine's ``start_load`` (posted), an RPC answer (a callback of the
:class:`~remote_g2.rpc.mux.RpcMux`), a rank's ``target_done`` (its link, or
the leader's share thread, posted), a clock (renew, a rank that never
answered) — and the coordinator moves the load through its states
(:mod:`.load`). No step of one load blocks another, so many loads to many
sources are in flight at once. How a lease is taken is a strategy
(:mod:`.resolve_strategies`): classic (source rank 0 resolves) or peer
(every rank with its peer source rank).

The leader waits for **every** rank's report before the engine hears, so no
rank still writes into a destination block by then. Then the lease: when
every rank finished before it could have expired on the source (its expiry,
counted from when the resolve was *sent*), the pins held for the whole READ,
so the load is done at once and the release goes out a moment later without
being waited for. Otherwise the release's answer decides (``RELEASING``): a
lease already gone fails the load, because the pins may have lapsed
mid-READ. Leases are renewed when a load outlives half its TTL.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import queue
import threading
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remote_g2.rpc.endpoint_list import EndpointRotation
from remote_g2.errors import ProtocolError, TransportError
from remote_g2.rpc.local_link import LinkClosed, MessageLink
from remote_g2.protocol.messages import GatherWish, Lookup, LookupReply, Release, Renew, TargetDone, TargetLoad
from remote_g2.rpc.mux import RpcMux

from .config import TargetConfig
from .load import LeaseClock, Load, LoadState
from .metrics import TargetMetrics
from .outcomes import Outcomes, drain
from .resolve_strategies import ClassicResolve, PeerResolve, ResolveStrategy
from .source_directory import SourceDirectory

if TYPE_CHECKING:
    from .client import TargetMatch

__all__ = ["Coordinator", "LOOKUP_CACHE"]

log = logging.getLogger("remote_g2.target")

LOOKUP_CACHE = 4096  # recent lookups kept so start_load reuses the scheduler's answer
# After a load is reported done, its lease's release waits this long, so that the engine's thread (woken by
# the report) gets the GIL — and on a busy or bound host the CPU, which the source rank answering the release
# may share — first; the leader's share thread waits as long before it frees its finished READs' handles.
RELEASE_AFTER_MS = 1.0


class Coordinator:
    """The leader's loads; :meth:`run` is the coordinator thread's body. Only :meth:`post` is for other threads.

    ``links``: rank → link to every other target rank; ``own_share``: hands
    the leader's share to its share thread (``None`` stops it); ``outcomes``:
    where finished requests go; ``lookups``/``lookups_lock``: the engine's
    recent lookup answers (``start_load`` of a matched prefix reuses them).
    """

    def __init__(self, *, worker_id: str, tp_size: int, config: TargetConfig, metrics: TargetMetrics,
                 stats: dict[str, int], mux: RpcMux, links: dict[int, MessageLink], outcomes: Outcomes,
                 own_share: queue.SimpleQueue[TargetLoad | None], share_thread: threading.Thread,
                 match_from: Any, compat_key: str | None,
                 lookups: OrderedDict[tuple[bytes, ...], TargetMatch], lookups_lock: threading.Lock,
                 kv_heads: int = 1, gather: bool = True) -> None:
        self.worker_id, self.tp_size, self.config = worker_id, tp_size, config
        self.kv_heads = kv_heads  # per rank: what a gather wish tells the source about this worker's ranks
        self._gather = gather  # the ranks can read staged parts (they have scratch words registered)
        self.metrics, self.stats, self.mux = metrics, stats, mux
        self.sources = SourceDirectory()
        # The registry servers lookups go to: the one in use, the next when it does not answer.
        self._registry = EndpointRotation(config.registry_endpoint) if config.registry_endpoint else None
        self._links = links
        self._link_fds: dict[int, int] = {}  # rank -> the fd its link is watched under, while it is up
        self._outcomes = outcomes
        self._shares = own_share
        self._share_thread = share_thread
        self._match_from = match_from
        self._compat_key = compat_key
        self._lookups, self._lookups_lock = lookups, lookups_lock
        self._classic, self._peer = ClassicResolve(self), PeerResolve(self)
        self._loads: dict[int, Load] = {}
        self._releases: list[tuple[float, Load]] = []  # (when due, load): done loads whose release waits
        self._ids = itertools.count(1)
        self._events: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)

    def gather_wish(self, source_tp: int) -> GatherWish | None:
        """What a resolve tells a source of ``source_tp`` ranks about this worker's readers (None: no gather)."""
        if not (self.config.gather and self._gather):
            return None
        return GatherWish(self.tp_size, self.kv_heads, self.is_mla, self.mla_offset(source_tp))

    @property
    def is_mla(self) -> bool:
        """Whether this worker's cache is MLA (its fingerprint says so): every rank reads whole blocks."""
        fp = self.config.fingerprint
        return bool(fp and fp.is_mla)

    def mla_offset(self, source_tp: int) -> int:
        """Which source rank this worker's rank 0 reads an MLA cache from (spread over the source's ranks)."""
        return zlib.crc32(self.worker_id.encode()) % max(1, source_tp)

    # -- from any thread -------------------------------------------------------------------

    def post(self, kind: str, item: Any) -> None:
        """Hand the coordinator an event (``start``, ``done``, ``stop``) from any thread, and wake it."""
        self._events.put((kind, item))
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):  # the pipe is full (it is awake anyway) or closed
            pass

    def close(self) -> None:
        """After :meth:`run` returned: close the wake-up pipe."""
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        self._wake_r = self._wake_w = -1

    # -- the loop --------------------------------------------------------------------------------

    def run(self) -> None:
        mux = self.mux
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
        self._share_thread.join(10)
        self._take_events()  # those reports
        self._send_releases(float("inf"))
        for load in list(self._loads.values()):
            self.fail(load, "the target client shut down")
        deadline = time.monotonic() + min(1.0, self.config.rpc_timeout_ms / 1000.0)
        while mux.pending() and time.monotonic() < deadline:  # let the releases go out and be answered
            mux.run_once(20)
        mux.close()

    def _take_events(self) -> bool:
        drain(self._wake_r)
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
                self.rank_done(item)

    def _until_next_clock_ms(self) -> float:
        now = time.monotonic()
        waits = [100.0]
        clocks = [t for load in self._loads.values()
                  for t in (load.report_by, *(lease.renew_at for lease in load.leases())) if t]
        if clocks:
            waits.append((min(clocks) - now) * 1000.0 + 0.5)  # past the clock, not just before it
        if self._releases:  # whole milliseconds: the poll's resolution (a shorter wait would spin)
            waits.append(math.ceil((self._releases[0][0] - now) * 1000.0))
        return max(0.0, min(waits))

    # -- a load's life ---------------------------------------------------------------------------

    def _begin(self, request_id: str, hashes: list[bytes], dst: list[int]) -> None:
        load = Load(next(self._ids), request_id, hashes, dst)
        self._loads[load.load_id] = load
        self.stats["loads"] += 1
        with self._lookups_lock:
            match = self._lookups.pop(tuple(hashes), None)
        if match is not None:
            self._resolve(load, match)
        elif self._registry is None:
            self.fail(load, "lookup: no_registry")
        else:
            self._look_up(load, self._registry.current, 1)

    def _look_up(self, load: Load, endpoint: str, attempt: int) -> None:
        self.mux.call(endpoint, Lookup(load.hashes, self.worker_id, self._compat_key, False),
                      lambda reply: self._looked_up(load, reply, endpoint, attempt))

    def _looked_up(self, load: Load, reply: LookupReply | Exception, endpoint: str, attempt: int) -> None:
        if not self.alive(load):
            return
        assert self._registry is not None
        if isinstance(reply, TransportError) and attempt < len(self._registry.endpoints):
            # No answer from that server: the next one of the failover list, which stays in use.
            nxt = self._registry.failed(endpoint)
            log.warning("registry %s: %s; looking up at %s", endpoint, reply, nxt)
            self._look_up(load, nxt, attempt + 1)
        elif isinstance(reply, Exception):
            self.fail(load, f"lookup: registry_error: {type(reply).__name__}: {reply}")
        else:
            self._resolve(load, self._match_from(reply))

    def _resolve(self, load: Load, match: TargetMatch) -> None:
        """Take the load's lease on ``match``'s source: the peer strategy when it can, else the classic one."""
        if match.reason != "ok" or match.endpoint is None or match.worker_id is None:
            self.fail(load, f"lookup: {match.reason}")
            return
        load.match = match
        self._start(load, self._peer if self._peer.ready(match) else self._classic)

    def _start(self, load: Load, strategy: ResolveStrategy) -> None:
        """Take the load's lease with ``strategy``; a bug in it fails the load instead of stranding it."""
        assert load.match is not None
        load.strategy = strategy
        try:
            strategy.start(load, load.match, min(load.match.matched, len(load.hashes)))
        except Exception as e:  # pragma: no cover - a bug; the engine must still hear of the load
            log.exception("load of %s: the %s strategy failed to start", load.request_id, strategy.name)
            if self.alive(load):
                self.fail(load, f"internal error starting the {strategy.name} resolve: {type(e).__name__}: {e}")

    def rank_done(self, done: TargetDone) -> None:
        """Rank ``done.rank`` finished its share of a load (or was given up on)."""
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
            if load.strategy is not None:
                load.strategy.rank_failed(load, done)
        if not load.waiting:
            self._complete(load)

    def _complete(self, load: Load) -> None:
        """Every rank answered (or was given up on): resolve again, report, or let the release decide."""
        if load.resolve_again and load.match is not None:
            # Classically, through rank 0, as the restart was noticed: its reply brings the new epoch's
            # metadata where the ranks lack it.
            log.info("load of %s: source %s restarted; resolving it again", load.request_id, load.match.worker_id)
            load.hand_back_tail()
            self._start(load, self._classic)
            return
        if load.dispatched:
            self.metrics.phase("reads", time.monotonic() - load.dispatched)
        if load.strategy is self._peer and not load.errors:
            # Each rank loaded the prefix its own peer pinned: the request has the shortest of them.
            load.keep_prefix(min(load.loaded.get(r, 0) for r in range(self.tp_size)))
        if load.errors:
            self.fail(load, "; ".join(load.errors))
        elif time.monotonic() < min(lease.expires for lease in load.leases()):
            # Every READ ended while the pins certainly held: the bytes are good whatever the release says.
            # The engine hears first; the release falls due RELEASE_AFTER_MS later (_send_releases).
            self._finish(load, None)
            self._releases.append((time.monotonic() + RELEASE_AFTER_MS / 1000.0, load))
        else:
            load.enter(LoadState.RELEASING)
            self._loads.pop(load.load_id, None)  # the releases' answers decide: no clock of ours applies any more
            self.send_release(load, lambda released: self._finish(
                load, None if all(released) else "the lease expired on the source before the load finished"))

    def _check_clocks(self) -> None:
        now = time.monotonic()
        for load in list(self._loads.values()):
            if load.report_by and now > load.report_by:
                load.errors.append(f"rank(s) {sorted(load.waiting)} did not answer in time")
                load.waiting.clear()
                self._complete(load)
            else:
                for lease in load.leases():
                    if lease.renew_at and now > lease.renew_at and not lease.renewing:
                        self._renew(load, lease)

    def _renew(self, load: Load, lease: LeaseClock) -> None:
        assert lease.endpoint is not None
        lease.renewing = True
        sent = time.monotonic()

        def on_renewed(reply: Any) -> None:
            lease.renewing = False
            if isinstance(reply, Exception):
                log.warning("renewing lease %d of %s: %s", lease.lease_id, load.request_id, reply)
                lease.renew_at = time.monotonic() + self.config.rpc_timeout_ms / 1000.0  # try again
            elif not reply.renewed:
                load.errors.append("the source dropped the lease before the load finished")
                lease.renew_at = 0.0
            else:
                lease.granted(sent, reply.expires_in_ms)

        self.mux.call(lease.endpoint, Renew(lease.lease_id, self.config.lease_ttl_ms), on_renewed)

    def _send_releases(self, now: float) -> None:
        """Send the releases due by ``now`` (queued in order, so they fall due in order).

        Due ``RELEASE_AFTER_MS`` after the report, however the report was
        made: one made inside the loop's poll (a rank's link) would otherwise
        have its release sent in the same step, and the source rank that
        takes it would run on the CPU the engine's thread is waking on.
        """
        while self._releases and self._releases[0][0] <= now:
            self.send_release(self._releases.pop(0)[1])

    # -- what the strategies call -------------------------------------------------------------------

    def alive(self, load: Load) -> bool:
        """Whether ``load`` is still in flight (not reported: not given up at shutdown, say)."""
        return load.load_id in self._loads

    def start_clocks(self, load: Load) -> int:
        """Every rank is about to get its share: start the load's clocks; the ranks' deadline (monotonic ns)."""
        now = time.monotonic_ns()
        deadline_ns = now + self.config.transfer_timeout_ms * 1_000_000
        load.dispatched = now / 1e9
        load.deadline = deadline_ns / 1e9
        load.report_by = load.deadline + self.config.rpc_timeout_ms / 1000.0
        load.waiting = set(range(self.tp_size))
        return deadline_ns

    def send_to_ranks(self, load: Load, msg: TargetLoad) -> None:
        """Send every rank > 0 its ``target_load`` (no waiting for acks); a rank it cannot reach fails its share."""
        for r in range(1, self.tp_size):
            try:
                self._links[r].send(msg)
            except LinkClosed as e:
                self._rank_gone(r, e)
            except ProtocolError as e:  # this message cannot be sent (too large); the link is fine
                self.rank_done(TargetDone(load.load_id, r, False, f"target_load to rank {r}: {e}"[:4000]))

    def own_share(self, msg: TargetLoad) -> None:
        """Hand the leader's own share to its share thread."""
        self._shares.put(msg)

    def send_release(self, load: Load, answered: Callable[[list[bool]], None] | None = None) -> None:
        """Release the load's leases; ``answered`` (if given) gets, once every one answered, whether each was
        released (an error counts as not). Without it nothing waits: the source's expiry covers a lost one."""
        leases = [lease for lease in load.leases() if lease.lease_id and lease.endpoint is not None]
        released: list[bool] = []
        for lease in leases:

            def on_release(reply: Any, lease: LeaseClock = lease) -> None:
                if isinstance(reply, Exception):
                    log.warning("releasing lease %d at %s: %s", lease.lease_id, lease.endpoint, reply)
                released.append(not isinstance(reply, Exception) and reply.released)
                if answered is not None and len(released) == len(leases):
                    answered(released)

            assert lease.endpoint is not None
            self.mux.call(lease.endpoint, Release(lease.lease_id), on_release)
        if answered is not None and not leases:
            answered(released)

    def fail(self, load: Load, why: str) -> None:
        self.send_release(load)
        self._finish(load, why)

    def _finish(self, load: Load, error: str | None) -> None:
        """Report the load to the engine (``error`` None: done) and forget it; never raises, never twice."""
        if load.state.finished:
            log.error("load %d of %s: reported twice (%s, then %s)", load.load_id, load.request_id,
                      load.state.name, error or "done")
            return
        try:
            load.enter(LoadState.FAILED if error else LoadState.DONE)
        except RuntimeError:  # pragma: no cover - a bug in the table; the engine must still hear
            log.exception("load %d: finishing from %s", load.load_id, load.state.name)
            load.state = LoadState.FAILED if error else LoadState.DONE
        self._loads.pop(load.load_id, None)
        ok = error is None
        # Counters and logs first: whoever wakes on the outcome finds them already moved.
        self.stats["done" if ok else "failed"] += 1
        invalid = load.invalid_tail if ok else load.dst + load.invalid_tail
        self.metrics.load(ok, time.monotonic() - load.started, len(load.dst) if ok else 0, len(invalid))
        if error:
            log.warning("load of %s failed after %.1f ms: %s", load.request_id,
                        (time.monotonic() - load.started) * 1e3, error)
        self._outcomes.add(load.request_id, ok, invalid, error or "")

    # -- the other ranks' links ---------------------------------------------------------------------

    def _from_rank(self, rank: int) -> None:
        """Rank ``rank``'s link is readable: its reports, or its departure."""
        try:
            reports = self._links[rank].receive()
        except (LinkClosed, ProtocolError) as e:
            self._rank_gone(rank, e)
            return
        for done in reports:
            if isinstance(done, TargetDone) and done.rank == rank:
                self.rank_done(done)
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
            self.mux.unwatch(fd)
            log.error("target rank %d is gone (%s): its loads fail, and every later one", rank, why)
        for load in list(self._loads.values()):
            if rank in load.waiting:
                self.rank_done(TargetDone(load.load_id, rank, False, f"target rank {rank} is gone: {why}"[:4000]))
