"""The registry's storage contract, shared by every backend.

Backends: :mod:`.memory` (embedded, one process), :mod:`.redis_store`
(single-node Redis, Lua scripts), the same module's cluster mode (Redis
Cluster, node-batched). One parametrized test suite
(``tests/test_registry_store.py``) holds them all to this contract.

Model
-----
* A **worker** is known by ``worker_id`` and registers with an ``epoch``. Each
  registration that starts afresh creates a new **incarnation** (an opaque,
  never-reused id inside the store). Blocks belong to an incarnation, so
  "drop everything this worker held" is O(1): switch the worker to a fresh
  incarnation and let :meth:`RegistryStore.sweep` delete the old one's
  entries in the background. Lookups only ever see the current incarnation.
* **Liveness** is a lease of ``lease_ttl_ms`` renewed by heartbeats. A worker
  whose lease lapsed is *dead*: invisible to lookups at once, answered
  ``unknown_worker`` on heartbeat/events, and swept later.
* **Events** arrive in batches numbered 1, 2, … per incarnation. A batch whose
  ``seq`` is not the next one is not applied and is answered
  ``resync_needed``. ``resync`` replaces the worker's whole block set.

Semantics every backend implements
----------------------------------
``register_worker(req)``
    * unknown worker, or its lease lapsed → new incarnation, ``next_seq=1``,
      ``new_incarnation=True``;
    * same epoch, live, same endpoint and fingerprint → lease renewed,
      blocks kept, ``next_seq = last_seq + 1``, ``new_incarnation=False``;
    * higher epoch → new incarnation (old blocks gone from lookups at once);
    * lower epoch, or same epoch with a different endpoint/fingerprint →
      :class:`~remote_g2.errors.StaleEpoch`.
``heartbeat(req)``
    renews the lease if the worker is live with that epoch (``ok``), else
    ``unknown_worker`` (register again, then resync). Records ``load``.
``apply_events(req)``
    ``unknown_worker`` unless live with that epoch; ``resync_needed`` unless
    ``seq == last_seq + 1`` (nothing applied); else applies in order —
    ``stored`` adds, ``removed`` deletes, ``cleared`` drops all — and answers
    ``ok`` with ``expected_seq = seq + 1`` and ``applied`` = hashes touched.
``resync(req)``
    ``unknown_worker`` unless live with that epoch; ``first`` drops all the
    worker's blocks before adding; ``last`` sets ``last_seq = seq - 1``.
    ``stored`` is the worker's block count afterwards.
``lookup(hashes, compat_key, requester, want_all_holders, tie_breaker)``
    candidates are the live holders of ``hashes[0]``; the requester is never
    a candidate; when ``compat_key`` is None and the requester is registered,
    the requester's compat key is used; a candidate with another compat key
    is excluded. Each candidate's ``matched`` is the length of the prefix of
    ``hashes`` it holds without a gap. Best: longest ``matched``, then lowest
    load, then ``tie_breaker`` modulo the tied count (over tied workers
    sorted by worker id); when more than 16 candidates hold the longest
    prefix, a store may break the tie among 16 of them (a popular prefix
    must not cost a lookup per holder; all of them with
    ``want_all_holders``). With no candidate the reason is
    ``incompatible_layout`` if an incompatible live holder was excluded, else
    ``source_is_target`` if the requester was the only live holder, else
    ``no_candidate``; ``matched`` is then 0 and ``best`` None. ``holders``
    (only with ``want_all_holders``): every candidate, by ``matched``
    descending then worker id.
``who_has(hashes, include_dead)``
    per hash, the sorted worker ids holding it (live only unless asked).
``worker_info`` / ``list_workers``
    :class:`~remote_g2.protocol.messages.WorkerRecord` (``blocks`` = the current
    incarnation's block count); ``list_workers`` sorted by worker id, dead
    workers only with ``include_dead``.
``scan_worker(worker_id, cursor, count)``
    one chunk of a live worker's hashes (at most about ``count``) and the
    cursor of the next (``b""`` when done; pass ``b""`` to start), with the
    worker's record as of this chunk (None and no hashes when it is unknown or
    dead). A hash held for the whole scan comes back at least once; one added
    or removed meanwhile may or may not. For mirrors (:mod:`remote_g2.registry.client.mirror`).
``drain_worker(worker_id)``
    forgets the worker and its blocks; a later register starts afresh.
``sweep()``
    deletes dead workers (lease lapsed) and the blocks of superseded or dead
    incarnations, a bounded amount per call; returns the number of retired
    incarnations whose entries were fully deleted (the memory store drops
    superseded ones at once, so it counts dead workers only). Safe to run
    from several servers at once.
``counts()``
    ``(workers_live, workers_total, block_entries)`` where block entries count
    (hash, live-or-dead worker) pairs not yet swept — approximate on Redis
    backends while a sweep is pending.

Errors: a store that cannot reach its backend raises
:class:`~remote_g2.errors.StoreUnavailable`; nothing else escapes as a
non-``RemoteG2Error``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from remote_g2.protocol.messages import (
    DrainWorkerReply, Events, EventsReply, Heartbeat, HeartbeatReply, Lookup, LookupReply, RegisterWorker,
    RegisterWorkerReply, Resync, ResyncReply, WorkerRecord,
)

__all__ = ["PendingLookups", "ConvertedLookups", "RegistryStore", "DEFAULT_LEASE_TTL_MS", "RESYNC_CHUNK",
           "resync_chunks"]

DEFAULT_LEASE_TTL_MS = 10_000
#: Hashes per ``resync`` message: a worker's snapshot goes in chunks of this many (:func:`resync_chunks`).
RESYNC_CHUNK = 16_384


def resync_chunks(hashes: Sequence[bytes], size: int = RESYNC_CHUNK) -> list[tuple[Sequence[bytes], bool, bool]]:
    """Split a snapshot into ``(chunk, first, last)`` for ``resync``; an empty pool is one empty chunk."""
    parts = [hashes[i:i + size] for i in range(0, len(hashes), size)] or [hashes[:0]]
    return [(part, i == 0, i == len(parts) - 1) for i, part in enumerate(parts)]


class PendingLookups(Protocol):
    """Lookups sent to a backend whose answers have not been read yet (see :meth:`RegistryStore.start_lookups`)."""

    def fileno(self) -> int: ...

    def result(self) -> list[LookupReply]: ...


class ConvertedLookups:
    """Pending answers of ``inner`` (anything with ``fileno()`` and ``result()``) passed through ``convert``.

    An exception of a type in ``errors`` from ``inner.result()`` is handed to
    ``on_error``, which returns the exception to raise instead (or re-raises).
    """

    def __init__(self, inner: Any, convert: Callable[[Any], list[LookupReply]], *,
                 errors: tuple[type[BaseException], ...] = (),
                 on_error: Callable[[BaseException], BaseException] | None = None) -> None:
        self._inner, self._convert, self._errors, self._on_error = inner, convert, errors, on_error

    def fileno(self) -> int:
        return self._inner.fileno()

    def result(self) -> list[LookupReply]:
        try:
            raw = self._inner.result()
        except self._errors as e:
            error = e if self._on_error is None else self._on_error(e)
            if error is e:
                raise
            raise error from e
        return self._convert(raw)


class RegistryStore(ABC):
    """Storage for worker records and block-hash → holder sets. Thread-safe."""

    #: Short backend name for stats and logs ("memory", "redis", "redis-cluster").
    name: str = "?"
    #: A counter that changes whenever ``list_workers`` may answer differently other than by a lease
    #: lapsing (a registration, heartbeat, drain or sweep); None where a backend cannot tell cheaply
    #: (Redis). The scoring API reuses its list of workers while it stays the same.
    generation: int | None = None

    def __init__(self, lease_ttl_ms: int = DEFAULT_LEASE_TTL_MS) -> None:
        if lease_ttl_ms <= 0:
            raise ValueError("lease_ttl_ms must be positive")
        self.lease_ttl_ms = lease_ttl_ms

    # -- worker side -------------------------------------------------------------

    @abstractmethod
    def register_worker(self, req: RegisterWorker) -> RegisterWorkerReply: ...

    @abstractmethod
    def heartbeat(self, req: Heartbeat) -> HeartbeatReply: ...

    @abstractmethod
    def apply_events(self, req: Events) -> EventsReply: ...

    @abstractmethod
    def resync(self, req: Resync) -> ResyncReply: ...

    # -- target side ---------------------------------------------------------------

    @abstractmethod
    def lookup(
        self,
        hashes: Sequence[bytes],
        *,
        compat_key: str | None = None,
        requester: str | None = None,
        want_all_holders: bool = False,
        tie_breaker: int = 0,
    ) -> LookupReply: ...

    def start_lookups(self, requests: Sequence[Lookup],
                      tie_breakers: Sequence[int]) -> PendingLookups | list[LookupReply]:
        """:meth:`lookup_many`, but a store that talks to a backend may return before the answers.

        Then it returns a :class:`PendingLookups`: the requests are on the
        wire, ``fileno()`` becomes readable when answers arrive and
        ``result()`` reads them (raising what :meth:`lookup_many` would). The
        server keeps reading new requests meanwhile, so the backend and the
        server work at the same time. The default answers at once.
        """
        return self.lookup_many(requests, tie_breakers)

    def lookup_many(self, requests: Sequence[Lookup], tie_breakers: Sequence[int]) -> list[LookupReply]:
        """Answer several lookups, in order; each as :meth:`lookup` would.

        The server hands over every lookup that queued up together; a store
        that can answer them in one backend round trip overrides this.
        """
        return [self.lookup(r.hashes, compat_key=r.compat_key, requester=r.requester,
                            want_all_holders=r.want_all_holders, tie_breaker=t)
                for r, t in zip(requests, tie_breakers, strict=True)]

    def held_prefixes(self, hashes: Sequence[bytes], compat_key: str) -> dict[str, int]:
        """worker id -> how many of ``hashes`` it holds from ``hashes[0]`` without a gap, for every live
        holder of ``hashes[0]`` of ``compat_key`` (the scoring API's question; ``hashes`` not empty).

        The default asks :meth:`lookup` for every holder; a store that can answer without building a
        :class:`~remote_g2.protocol.messages.LookupReply` overrides it.
        """
        reply = self.lookup(hashes, compat_key=compat_key, want_all_holders=True)
        return {h.worker_id: h.matched for h in reply.holders}

    def holds_any(self, block_hash: bytes) -> bool | None:
        """Whether any worker holds ``block_hash`` (live or not, of any layout), where the store can tell
        without a round trip to a backend; None where it cannot (the default).

        The scoring API hashes a prompt only as far as its blocks are held anywhere, when this can tell.
        """
        return None

    # -- admin -------------------------------------------------------------------------

    @abstractmethod
    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> list[list[str]]: ...

    @abstractmethod
    def worker_info(self, worker_id: str) -> WorkerRecord | None: ...

    @abstractmethod
    def list_workers(self, *, include_dead: bool = False) -> list[WorkerRecord]: ...

    @abstractmethod
    def scan_worker(self, worker_id: str, cursor: bytes, count: int) -> tuple[WorkerRecord | None, list[bytes], bytes]:
        ...

    @abstractmethod
    def drain_worker(self, worker_id: str) -> DrainWorkerReply: ...

    @abstractmethod
    def sweep(self) -> int: ...

    @abstractmethod
    def counts(self) -> tuple[int, int, int]: ...

    def prepare(self) -> None:
        """Called once by a server before it answers anything; a store that keeps state about its
        backend (the Redis stores' topology) records it here. Must not raise for an unreachable backend."""

    def ping(self) -> None:
        """Raise :class:`~remote_g2.errors.StoreUnavailable` if the backend is unreachable."""

    def close(self) -> None:
        """Release connections; idempotent."""
