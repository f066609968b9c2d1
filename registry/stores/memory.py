"""The embedded registry store: plain dicts under one lock, for one box.

It is the default of ``remote-g2 serve``, the copy a registry mirror keeps
(:mod:`remote_g2.registry.client.mirror`), and the readable reference for the contract in
:mod:`.contract`. Superseded incarnations are dropped synchronously (the cost is
one pass over their blocks); dead ones are found by :meth:`MemoryStore.sweep`.

The reverse map, hash → holders, is the C++ :class:`~remote_g2.registry.stores.holder_index.HolderIndex`,
because a lookup is one probe of it per asked hash and at a million entries
each probe of a dict of sets costs a couple of cache misses where a probe of
the C++ table costs one (``bench/registry/bench_holder_index.py``; docs/benchmarks.md,
"holder index"). The store also keeps each incarnation's blocks as a Python
set, for ``scan_worker`` and drops; a copy that never scans (a registry
mirror, ``keeps_block_sets = False``) keeps only a count per incarnation and
drops one with a pass over the index, so it costs the index's 20–40 bytes a
hash and no more.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from remote_g2.errors import StaleEpoch
from remote_g2.registry.stores.holder_index import HolderIndex
from remote_g2.protocol.messages import (
    DrainWorkerReply, Events, EventsReply, Heartbeat, HeartbeatReply, Holder, LayoutFingerprint, LookupReply,
    RegisterWorker, RegisterWorkerReply, Resync, ResyncReply, WorkerKind, WorkerRecord,
)

from .contract import DEFAULT_LEASE_TTL_MS, RegistryStore

__all__ = ["MemoryStore", "TIE_LIMIT"]

#: A best-holder lookup breaks a tie among at most this many holders of the longest prefix.
TIE_LIMIT = 16


@dataclass
class _Incarnation:
    inc: int
    worker_id: str
    epoch: int
    endpoint: str
    fingerprint: LayoutFingerprint
    compat: str
    kind: WorkerKind | None
    registered_at_ms: int
    expires_at: float
    blocks: set[bytes] = field(default_factory=set)  # empty unless the store keeps_block_sets
    count: int = 0  # (hash, this incarnation) pairs in the holder index
    last_seq: int = 0
    load: int = 0


class MemoryStore(RegistryStore):
    """In-process store; ``clock`` (seconds, monotonic) is injectable for tests."""

    name = "memory"
    keeps_block_sets = True
    """Whether each incarnation's hashes are kept as a set (``scan_worker`` needs them)."""

    def __init__(self, lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(lease_ttl_ms)
        self._clock = clock
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._workers: dict[str, _Incarnation] = {}
        self._holders = HolderIndex()
        self._incs: dict[int, _Incarnation] = {}
        self.generation = 0  # see RegistryStore.generation

    # -- helpers (lock held) -------------------------------------------------------

    def _live(self, rec: _Incarnation) -> bool:
        return rec.expires_at > self._clock()

    def _current(self, worker_id: str, epoch: int) -> _Incarnation | None:
        rec = self._workers.get(worker_id)
        if rec is None or rec.epoch != epoch or not self._live(rec):
            return None
        return rec

    def _add(self, rec: _Incarnation, hashes: Iterable[bytes]) -> int:
        """Add ``hashes`` to the incarnation; returns how many were given (the ``applied`` count)."""
        hashes = list(hashes)
        rec.count += self._holders.add(rec.inc, hashes)  # validates every hash before anything changes
        if self.keeps_block_sets:
            rec.blocks.update(hashes)
        return len(hashes)

    def _remove(self, rec: _Incarnation, hashes: Iterable[bytes]) -> int:
        """Remove ``hashes`` from the incarnation; returns how many were given."""
        hashes = list(hashes)
        rec.count -= self._holders.remove(rec.inc, hashes)
        if self.keeps_block_sets:
            rec.blocks.difference_update(hashes)
        return len(hashes)

    def _clear(self, rec: _Incarnation) -> int:
        """Remove all of the incarnation's blocks; returns how many it had."""
        n = rec.count
        if self.keeps_block_sets:
            self._holders.remove(rec.inc, list(rec.blocks))
            rec.blocks.clear()
        else:
            self._holders.drop_holder(rec.inc)
        rec.count = 0
        return n

    def _drop_incarnation(self, rec: _Incarnation) -> int:
        n = self._clear(rec)
        self._incs.pop(rec.inc, None)
        return n

    def _new_incarnation(self, req: RegisterWorker) -> _Incarnation:
        rec = _Incarnation(
            inc=next(self._ids), worker_id=req.worker_id, epoch=req.epoch, endpoint=req.endpoint,
            fingerprint=req.fingerprint, compat=req.fingerprint.compat_key(), kind=req.kind,
            registered_at_ms=int(time.time() * 1000), expires_at=self._clock() + self.lease_ttl_ms / 1000,
        )
        self._incs[rec.inc] = rec
        self._workers[req.worker_id] = rec
        return rec

    def _record(self, rec: _Incarnation) -> WorkerRecord:
        left = rec.expires_at - self._clock()
        return WorkerRecord(
            worker_id=rec.worker_id, endpoint=rec.endpoint, epoch=rec.epoch, tp_size=rec.fingerprint.tp_size,
            fingerprint=rec.fingerprint, live=left > 0, lease_expires_in_ms=int(left * 1000),
            blocks=rec.count, last_seq=rec.last_seq, load=rec.load, registered_at_ms=rec.registered_at_ms,
            kind=rec.kind,
        )

    # -- worker side -------------------------------------------------------------------

    def register_worker(self, req: RegisterWorker) -> RegisterWorkerReply:
        with self._lock:
            self.generation += 1
            old = self._workers.get(req.worker_id)
            if old is not None and self._live(old):
                if req.epoch < old.epoch:
                    raise StaleEpoch(f"worker {req.worker_id!r} registered with epoch {req.epoch}, "
                                     f"older than the live epoch {old.epoch}")
                if req.epoch == old.epoch:
                    if (req.endpoint, req.fingerprint, req.kind) != (old.endpoint, old.fingerprint, old.kind):
                        raise StaleEpoch(f"worker {req.worker_id!r} re-registered epoch {req.epoch} with a "
                                         "different endpoint, fingerprint or kind; use a new epoch")
                    old.expires_at = self._clock() + self.lease_ttl_ms / 1000
                    return RegisterWorkerReply(self.lease_ttl_ms, old.last_seq + 1, False)
            if old is not None:
                self._drop_incarnation(old)
            self._new_incarnation(req)
            return RegisterWorkerReply(self.lease_ttl_ms, 1, True)

    def heartbeat(self, req: Heartbeat) -> HeartbeatReply:
        with self._lock:
            rec = self._current(req.worker_id, req.epoch)
            if rec is None:
                return HeartbeatReply("unknown_worker", 0)
            rec.expires_at = self._clock() + self.lease_ttl_ms / 1000
            rec.load = req.load
            self.generation += 1
            return HeartbeatReply("ok", self.lease_ttl_ms)

    def apply_events(self, req: Events) -> EventsReply:
        with self._lock:
            rec = self._current(req.worker_id, req.epoch)
            if rec is None:
                return EventsReply("unknown_worker", 0, 0)
            if req.seq != rec.last_seq + 1:
                return EventsReply("resync_needed", rec.last_seq + 1, 0)
            applied = 0
            for ev in req.events:
                if ev.kind == "stored":
                    applied += self._add(rec, ev.hashes)
                elif ev.kind == "removed":
                    applied += self._remove(rec, ev.hashes)
                else:
                    applied += self._clear(rec)
            rec.last_seq = req.seq
            return EventsReply("ok", req.seq + 1, applied)

    def resync(self, req: Resync) -> ResyncReply:
        with self._lock:
            rec = self._current(req.worker_id, req.epoch)
            if rec is None:
                return ResyncReply("unknown_worker", 0, 0)
            if req.first:
                self._clear(rec)
            self._add(rec, req.hashes)
            if req.last:
                rec.last_seq = req.seq - 1
            return ResyncReply("ok", rec.last_seq + 1, rec.count)

    # -- target side ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, compat_key: str | None = None, requester: str | None = None,
               want_all_holders: bool = False, tie_breaker: int = 0) -> LookupReply:
        with self._lock:
            if compat_key is None and requester is not None and requester in self._workers:
                compat_key = self._workers[requester].compat
            saw = {"self": False, "incompatible": False}
            now, incs, workers = self._clock(), self._incs, self._workers

            def eligible(holders: list[int]) -> list[_Incarnation]:
                # A popular block is held by much of the fleet: this loop is per holder, keep it lean.
                out = []
                for inc in holders:
                    rec = incs[inc]
                    if rec.expires_at <= now or workers.get(rec.worker_id) is not rec:
                        continue
                    if rec.worker_id == requester:
                        saw["self"] = True
                    elif compat_key is not None and rec.compat != compat_key:
                        saw["incompatible"] = True
                    else:
                        out.append(rec)
                return out

            first = self._holders.holders(hashes[0])
            if want_all_holders or len(first) <= 2 * TIE_LIMIT:  # a few holders: walking each is cheaper
                cands = eligible(first)
                if cands:
                    ids = [rec.inc for rec in cands]
                    return _choose(cands, dict(zip(ids, self._holders.walk(hashes, ids))), want_all_holders,
                                   tie_breaker)
            else:
                cands, top = self._longest_held(hashes, eligible)
                if cands:
                    return _choose(cands, {rec.inc: top for rec in cands}, False, tie_breaker)
            reason = ("incompatible_layout" if saw["incompatible"]
                      else "source_is_target" if saw["self"] else "no_candidate")
            return LookupReply(reason, 0)

    def holds_any(self, block_hash: bytes) -> bool | None:
        with self._lock:
            return bool(self._holders.holders(block_hash))

    def held_prefixes(self, hashes: Sequence[bytes], compat_key: str) -> dict[str, int]:
        with self._lock:
            now, incs, workers = self._clock(), self._incs, self._workers
            cands = [rec for inc in self._holders.holders(hashes[0])
                     if (rec := incs[inc]).compat == compat_key and rec.expires_at > now
                     and workers.get(rec.worker_id) is rec]
            if not cands:
                return {}
            return {rec.worker_id: n for rec, n in zip(cands, self._holders.walk(hashes, [r.inc for r in cands]))}

    def _longest_held(self, hashes: Sequence[bytes],
                      eligible: Callable[[list[int]], list[_Incarnation]]) -> tuple[list[_Incarnation], int]:
        """(eligible incarnations holding ``hashes[:p]`` whole, p) for the largest such p; ([], 0) if none.

        Binary search on p: a probe asks the holders of ``hashes[p - 1]``,
        ``TIE_LIMIT`` at a time, whether they hold the first p hashes, and stops
        at the first that does, so a prefix most of the fleet holds costs a few
        candidates per probe, not each of them; each holder's eligibility is
        decided once. The answer lists at most ``TIE_LIMIT`` of the holders of
        the whole prefix (the tie is broken among them). Lock held.
        """
        verdict: dict[int, _Incarnation | None] = {}

        def witnesses(p: int, limit: int) -> list[_Incarnation]:
            holders = self._holders.holders(hashes[p - 1])
            # walk() takes its first hash as held (they hold hashes[p - 1]) and checks the rest in order.
            seq, found = [hashes[p - 1], *hashes[:p]], []
            for s in range(0, len(holders), TIE_LIMIT):  # a slice at a time: most probes stop in the first
                part = holders[s:s + TIE_LIMIT]
                fresh = [inc for inc in part if inc not in verdict]
                if fresh:
                    ok = {rec.inc: rec for rec in eligible(fresh)}
                    verdict.update((inc, ok.get(inc)) for inc in fresh)
                cands = [rec for inc in part if (rec := verdict[inc]) is not None]
                if cands and p > 1:
                    cands = [rec for rec, r in zip(cands, self._holders.walk(seq, [c.inc for c in cands]))
                             if r == p + 1]
                found += cands
                if len(found) >= limit:
                    break
            return found[:limit]

        n = len(hashes)
        best = witnesses(n, TIE_LIMIT)
        if best:
            return best, n
        lo, hi, top = 1, n - 1, 0
        while lo <= hi:
            mid = (lo + hi) // 2
            if witnesses(mid, 1):
                top, lo = mid, mid + 1
            else:
                hi = mid - 1
        return (witnesses(top, TIE_LIMIT), top) if top else ([], 0)

    # -- admin -------------------------------------------------------------------------------

    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> list[list[str]]:
        with self._lock:
            out = []
            for h in hashes:
                ids = {self._incs[i].worker_id for i in self._holders.holders(h)
                       if include_dead or self._live(self._incs[i])}
                out.append(sorted(ids))
            return out

    def worker_info(self, worker_id: str) -> WorkerRecord | None:
        with self._lock:
            rec = self._workers.get(worker_id)
            return None if rec is None else self._record(rec)

    def list_workers(self, *, include_dead: bool = False) -> list[WorkerRecord]:
        with self._lock:
            return [self._record(r) for _, r in sorted(self._workers.items())
                    if include_dead or self._live(r)]

    def scan_worker(self, worker_id: str, cursor: bytes, count: int) -> tuple[WorkerRecord | None, list[bytes], bytes]:
        # The cursor is the last hash returned: resuming "after it" in sorted
        # order skips nothing that stayed, whatever was added or removed since.
        if not self.keeps_block_sets:
            raise NotImplementedError(f"a {self.name} store keeps no per-worker block lists to scan")
        with self._lock:
            rec = self._workers.get(worker_id)
            if rec is None or not self._live(rec):
                return None, [], b""
            # The next count+1 in order, without sorting the whole rest under the lock on every chunk.
            ahead = heapq.nsmallest(count + 1, (h for h in rec.blocks if h > cursor) if cursor else rec.blocks)
            chunk = ahead[:count]
            return self._record(rec), chunk, (chunk[-1] if len(ahead) > count else b"")

    def drain_worker(self, worker_id: str) -> DrainWorkerReply:
        with self._lock:
            rec = self._workers.pop(worker_id, None)
            if rec is None:
                return DrainWorkerReply(False, 0)
            self.generation += 1
            return DrainWorkerReply(True, self._drop_incarnation(rec))

    def sweep(self) -> int:
        with self._lock:
            dead = [r for r in self._workers.values() if not self._live(r)]
            for rec in dead:
                del self._workers[rec.worker_id]
                self._drop_incarnation(rec)
            self.generation += bool(dead)
            return len(dead)

    def counts(self) -> tuple[int, int, int]:
        with self._lock:
            live = sum(1 for r in self._workers.values() if self._live(r))
            entries = sum(r.count for r in self._incs.values())
            return live, len(self._workers), entries


def _choose(cands: Sequence[_Incarnation], matched: dict[int, int], want_all: bool, tie_breaker: int) -> LookupReply:
    """Pick the best candidate by (matched desc, load asc, tie_breaker over worker id)."""
    top = max(matched.values())
    tied = [r for r in cands if matched[r.inc] == top]
    low = min(r.load for r in tied)
    tied = sorted((r for r in tied if r.load == low), key=lambda r: r.worker_id)
    best = tied[tie_breaker % len(tied)]

    def holder(r: _Incarnation) -> Holder:
        return Holder(r.worker_id, r.endpoint, r.fingerprint.tp_size, matched[r.inc])

    holders = []
    if want_all:
        holders = [holder(r) for r in sorted(cands, key=lambda r: (-matched[r.inc], r.worker_id))]
    return LookupReply("ok", top, holder(best), holders)
