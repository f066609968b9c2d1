"""Leases: which pins a rank holds for which remote reader, and until when.

Every rank of a source keeps its own :class:`LeaseTable`: rank 0 for the
blocks it pinned itself, each sibling for its own. A lease is a list of
block ids pinned once each (in the order of the hashes asked) and a
deadline on this process's monotonic clock. Whatever ends a lease —
release, trim, expiry, shutdown — drops exactly the pins it recorded, so a
lost ``release`` costs pins only until the deadline and never leaks them.

Pins are dropped outside the table's lock: once a lease (or its tail) has
left the table nobody else can reach those pins, and the pool's own calls
are atomic. Tails are unpinned tail first, so the head of a prefix becomes
the most recently used block and is evicted last.

Every rank also charges its own :class:`PinBudget`, in one of two ways.
A rank that decides a lease's length itself (rank 0 for a resolve, any
rank for its ``peer_resolve`` share) reserves up to one block per asked
hash first (atomically, so concurrent resolves never overshoot) and pins
less, or nothing, when the budget is short. A sibling pinning for rank 0
(``sibling_pin`` / ``sibling_resolve``) charges what it pinned without
being refused: rank 0 already bounded that lease with its own budget, and
a sibling's count can lag rank 0's by the releases still on their way to
it, so refusing there would cut leases rank 0 has room for. Either way the
table gives the pins back as leases shrink or end.

Every share belongs to an owner: the identity of the connection that
resolved it (remote_g2/rpc/connection_identity.py), drawn by the server and
never chosen by a client; rank 0 hands it to its siblings with each pin.
Only that owner can renew or release it; anyone else is answered as for an
unknown lease. There is no "anyone may end it" owner.

Released lease ids are remembered for a while (tombstones) so that a
``sibling_pin`` arriving after rank 0 gave up on it and released the lease
is refused instead of pinning blocks nobody will release.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .progress_pace import ServedOwners, readers_of
from remote_g2.memory.secondary_pool import SecondaryPool
from remote_g2.errors import SourceError

__all__ = ["Lease", "LeaseTable", "PinBudget"]

log = logging.getLogger("remote_g2.source.leases")

#: How many released lease ids a table remembers (each costs ~100 bytes).
MAX_TOMBSTONES = 65_536

#: Connections remembered as served (an owner forgotten is only polled fast again for its next lease)


class PinBudget:
    """How many blocks remote leases may hold pinned on one rank; thread-safe."""

    def __init__(self, limit: int, on_change: Callable[[int], None] | None = None) -> None:
        if limit < 1:
            raise ValueError(f"pin budget must be >= 1 block, got {limit}")
        self.limit = limit
        self._used = 0
        self._lock = threading.Lock()
        self._on_change = on_change

    @property
    def available(self) -> int:
        """Blocks :meth:`reserve` could grant now (0 while :meth:`charge` ran the budget over)."""
        with self._lock:
            return max(0, self.limit - self._used)

    def reserve(self, wanted: int) -> int:
        """Take up to ``wanted`` blocks of the budget; return how many were granted (maybe 0)."""
        with self._lock:
            granted = max(0, min(wanted, self.limit - self._used))
            self._used += granted
            left = self.limit - self._used
        if granted:
            self._changed(left)
        return granted

    def charge(self, n: int) -> None:
        """Take ``n`` blocks whether or not they are left (pins another rank's budget already allowed).

        The budget may run over its limit for a moment; :meth:`reserve`
        grants nothing until enough is given back.
        """
        if n <= 0:
            return
        with self._lock:
            self._used += n
            left = self.limit - self._used
        self._changed(left)

    def give_back(self, n: int) -> None:
        """Return ``n`` blocks taken by :meth:`reserve` or :meth:`charge`."""
        if n <= 0:
            return
        with self._lock:
            if n > self._used:  # a bookkeeping bug; never let the budget grow past its limit
                log.error("pin budget: giving back %d blocks but only %d are in use", n, self._used)
                n = self._used
            self._used -= n
            left = self.limit - self._used
        self._changed(left)

    def _changed(self, left: int) -> None:
        if self._on_change is not None:
            self._on_change(max(0, left))  # as :attr:`available` reads it


@dataclass(slots=True)
class Lease:
    """One lease as a rank holds it: its pinned blocks, its deadline (``time.monotonic()``) and owner.

    ``owner`` is the identity of the connection that resolved it (see the module docstring);
    ``worker_wide`` (rank 0): a ``resolve``'s lease, whose siblings hold shares for the same owner
    (not a ``peer_resolve`` share, which is this rank's alone).
    """

    lease_id: int
    block_ids: list[int]
    deadline: float
    owner: bytes
    worker_wide: bool = False


class LeaseTable:
    """The pins one rank holds per lease, with expiry; every method is thread-safe.

    ``budget`` (rank 0) is credited whenever pins leave the table.
    ``on_change(open_leases, pinned_blocks)`` is called after every change
    (for gauges), outside the lock. ``on_end(lease_id)`` is called once for
    every lease that ended (release, trim to nothing, expiry, shutdown),
    after its pins were dropped, outside the lock: what else the lease held
    (its staging ranges) goes with it.
    """

    def __init__(self, pool: SecondaryPool, *, budget: PinBudget | None = None,
                 tombstone_ttl_s: float = 120.0,
                 on_change: Callable[[int, int], None] | None = None,
                 on_end: Callable[[int], None] | None = None) -> None:
        self._pool = pool
        self._budget = budget
        self._leases: dict[int, Lease] = {}
        self._deadlines: list[tuple[float, int]] = []  # heap; stale entries skipped when popped
        self._tombstones: OrderedDict[int, float] = OrderedDict()  # lease id -> forget after
        self._tombstone_ttl = tombstone_ttl_s
        self._pinned = 0
        self._lock = threading.Lock()
        self._served = ServedOwners()  # owners that released a lease (see readers())
        self._on_change = on_change
        self._on_end = on_end

    # -- reading -----------------------------------------------------------------------

    @property
    def open_leases(self) -> int:
        return len(self._leases)

    def readers(self) -> str:
        """Who holds the open leases, for the progress pace (``source/progress_pace.py``).

        ``none``; ``new``: a connection that has not yet released a lease here
        holds one (its reader's first READ may still be wiring UCX up, which
        needs this side's progress); ``local``: only readers on this host;
        ``remote``: any reader elsewhere.
        """
        with self._lock:
            return readers_of({lease.owner for lease in self._leases.values()}, self._served)

    @property
    def pinned_blocks(self) -> int:
        """Block pins this table holds (a block pinned by two leases counts twice)."""
        return self._pinned

    def get(self, lease_id: int) -> Lease | None:
        """A copy of the lease, or None."""
        with self._lock:
            lease = self._leases.get(lease_id)
            return None if lease is None else Lease(lease.lease_id, list(lease.block_ids), lease.deadline, lease.owner,
                                                    lease.worker_wide)

    def next_deadline(self) -> float | None:
        """The earliest deadline of an open lease (maybe a stale, earlier one), or None."""
        with self._lock:
            return self._deadlines[0][0] if self._deadlines else None

    # -- changing ----------------------------------------------------------------------

    def pin(self, lease_id: int, hashes: Sequence[bytes], deadline: float, owner: bytes, *,
            worker_wide: bool = False) -> list[int]:
        """Find-and-pin ``hashes`` on the pool under ``lease_id`` until ``deadline``, for ``owner``.

        Returns the pinned block ids (the longest present prefix). Nothing is
        recorded when nothing was pinned. :class:`SourceError` when the lease
        id is open already or was released recently (its pins are dropped).
        """
        if not owner:
            raise ValueError("a lease needs an owner (the identity of the connection that resolved it)")
        with self._lock:
            self._check_new(lease_id)
        ids = list(self._pool.find_and_pin(hashes))
        if not ids:
            return ids
        with self._lock:
            try:
                self._check_new(lease_id)
            except SourceError:
                refused = True
            else:
                refused = False
                self._leases[lease_id] = Lease(lease_id, list(ids), deadline, owner, worker_wide)  # caller keeps its list
                heapq.heappush(self._deadlines, (deadline, lease_id))
                self._pinned += len(ids)
        if refused:
            self._unpin(ids, lease_id, credit=False)  # never recorded, so never charged
            raise SourceError(f"lease {lease_id} was released or is already open on this rank")
        self._changed()
        return ids

    def pin_within_budget(self, lease_id: int, hashes: Sequence[bytes], deadline: float,
                          owner: bytes) -> list[int] | None:
        """:meth:`pin` at most as many hashes as the table's budget has room for; None: no room at all.

        Reserves first (atomically, so concurrent callers never overshoot),
        pins, and gives back what was not pinned. Without a budget it is
        :meth:`pin`.
        """
        budget = self._budget
        if budget is None:
            return self.pin(lease_id, hashes, deadline, owner)
        granted = budget.reserve(len(hashes))
        if granted == 0:
            return None
        return self._pin_taken(budget, granted, lease_id, hashes, deadline, owner)

    def pin_charged(self, lease_id: int, hashes: Sequence[bytes], deadline: float, owner: bytes) -> list[int]:
        """:meth:`pin` for a lease another rank's budget bounds: charge what was pinned, refuse nothing.

        How a sibling pins for rank 0 (see the module docstring).
        """
        budget = self._budget
        if budget is None:
            return self.pin(lease_id, hashes, deadline, owner)
        # Charged up front so that a release racing the pin never gives back pins not yet charged.
        budget.charge(len(hashes))
        return self._pin_taken(budget, len(hashes), lease_id, hashes, deadline, owner)

    def _pin_taken(self, budget: PinBudget, taken: int, lease_id: int, hashes: Sequence[bytes], deadline: float,
                   owner: bytes) -> list[int]:
        """:meth:`pin` the first ``taken`` hashes, for which ``budget`` was charged; give back what was not pinned."""
        try:
            ids = self.pin(lease_id, hashes[:taken], deadline, owner)
        except BaseException:
            budget.give_back(taken)
            raise
        budget.give_back(taken - len(ids))
        return ids

    def trim(self, lease_id: int, keep: int) -> bool:
        """Keep the first ``keep`` blocks of the lease and unpin the rest; False if unknown.

        ``keep == 0`` ends the lease. Only for the rank that just pinned it
        (rank 0 cutting a lease to the prefix every rank holds): no owner check.
        """
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None:
                return False
            if keep <= 0:
                del self._leases[lease_id]
                self._tombstone(lease_id)
            tail = lease.block_ids[max(0, keep):]
            del lease.block_ids[max(0, keep):]
            self._pinned -= len(tail)
        if tail:
            self._unpin(tail, lease_id)
            self._changed()
        if keep <= 0:
            self._ended(lease_id)
        return True

    def release(self, lease_id: int, owner: bytes) -> bool:
        """End ``owner``'s lease and drop its pins; False if unknown or someone else's (idempotent).

        Someone else's lease is left alone and not remembered as released: to
        the caller it looks exactly like an unknown one.
        """
        return self.release_lease(lease_id, owner) is not None

    def release_lease(self, lease_id: int, owner: bytes) -> Lease | None:
        """:meth:`release`, answering with the lease it ended (its pins already dropped), or None."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is not None and lease.owner != owner:
                return None
            lease = self._leases.pop(lease_id, None)
            self._tombstone(lease_id)
            if lease is None:
                return None
            self._pinned -= len(lease.block_ids)
            self._served.add(lease.owner)
        self._unpin(lease.block_ids, lease_id)
        self._changed()
        self._ended(lease_id)
        return lease

    def renew(self, lease_id: int, deadline: float, owner: bytes) -> bool:
        """Move ``owner``'s lease's deadline to ``deadline``; False if it is gone, expired or someone else's."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or lease.deadline <= time.monotonic() or lease.owner != owner:
                return False
            lease.deadline = deadline
            heapq.heappush(self._deadlines, (deadline, lease_id))
            return True

    def reap(self, now: float | None = None) -> list[Lease]:
        """End every lease whose deadline passed; return them (their pins already dropped)."""
        now = time.monotonic() if now is None else now
        expired: list[Lease] = []
        with self._lock:
            while self._deadlines and self._deadlines[0][0] <= now:
                deadline, lease_id = heapq.heappop(self._deadlines)
                lease = self._leases.get(lease_id)
                if lease is None or lease.deadline != deadline:
                    continue  # released, or renewed (a later heap entry stands for it)
                del self._leases[lease_id]
                self._tombstone(lease_id)
                self._pinned -= len(lease.block_ids)
                expired.append(lease)
            while self._tombstones and next(iter(self._tombstones.values())) <= now:
                self._tombstones.popitem(last=False)
        for lease in expired:
            self._unpin(lease.block_ids, lease.lease_id)
        if expired:
            self._changed()
        for lease in expired:
            self._ended(lease.lease_id)
        return expired

    def release_all(self) -> int:
        """End every lease (shutdown); return how many there were."""
        with self._lock:
            leases = list(self._leases.values())
            self._leases.clear()
            self._deadlines.clear()
            self._pinned = 0
        for lease in leases:
            self._unpin(lease.block_ids, lease.lease_id)
        self._changed()
        for lease in leases:
            self._ended(lease.lease_id)
        return len(leases)

    # -- internals ---------------------------------------------------------------------

    def _check_new(self, lease_id: int) -> None:
        if lease_id in self._leases or lease_id in self._tombstones:
            raise SourceError(f"lease {lease_id} was released or is already open on this rank")

    def _tombstone(self, lease_id: int) -> None:
        self._tombstones[lease_id] = time.monotonic() + self._tombstone_ttl
        self._tombstones.move_to_end(lease_id)
        while len(self._tombstones) > MAX_TOMBSTONES:
            self._tombstones.popitem(last=False)

    def _unpin(self, block_ids: list[int], lease_id: int, *, credit: bool = True) -> None:
        try:
            self._pool.unpin_blocks_by_id(block_ids[::-1])
        except Exception:  # a pool that lost our pins is a bug elsewhere; never let it kill a reaper
            log.exception("lease %d: unpinning %d blocks failed", lease_id, len(block_ids))
        if credit and self._budget is not None:
            self._budget.give_back(len(block_ids))

    def _ended(self, lease_id: int) -> None:
        if self._on_end is not None:
            try:
                self._on_end(lease_id)
            except Exception:  # never let a hook kill a reaper or a release
                log.exception("lease %d: on_end hook failed", lease_id)

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(len(self._leases), self._pinned)
