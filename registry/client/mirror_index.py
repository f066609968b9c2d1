"""The registry mirror's copy: :class:`MirrorIndex`, a memory store filled from snapshots and fed the servers' writes.

:class:`~registry.mirror.RegistryMirror` (which follows the change feeds)
owns one; a snapshot installs each worker, and every feed frame is replayed
into it. Kept apart from the follower so each file holds one object.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from remote_g2.errors import StaleEpoch
from remote_g2.protocol.messages import DrainWorker, Events, Heartbeat, RegisterWorker, Resync, WorkerRecord

from ..stores.memory import MemoryStore, _Incarnation

__all__ = ["MirrorIndex"]


class MirrorIndex(MemoryStore):
    """The mirror's copy: a :class:`MemoryStore` filled from snapshots and fed the writes the servers applied.

    With ``compat_key`` it holds only the workers whose layout has that key
    (the blocks a target of that layout can use); every write of another
    worker is skipped, and a worker that re-registers with another layout
    leaves the copy. Its lookups of that layout answer as the server's, except
    that blocks only other layouts hold are ``no_candidate`` rather than
    ``incompatible_layout`` (either way: nothing to reuse).
    """

    name = "mirror"
    keeps_block_sets = False  # a copy answers lookups only: the holder index is all it keeps per hash

    def __init__(self, lease_ttl_ms: int, compat_key: str | None = None) -> None:
        super().__init__(lease_ttl_ms)
        self.compat_key = compat_key
        self._ignored: set[str] = set()  # workers of another layout: their writes are skipped

    def follows(self, record: WorkerRecord) -> bool:
        """Whether this copy holds ``record``'s worker (else it is noted as one whose writes are skipped)."""
        if self.compat_key is None or record.fingerprint.compat_key() == self.compat_key:
            return True
        with self._lock:
            self._ignored.add(record.worker_id)
        return False

    @property
    def ignored(self) -> int:
        """Workers of another layout this copy skips."""
        return len(self._ignored)

    def install(self, record: WorkerRecord, hashes: Iterable[bytes]) -> None:
        """Take a worker's record and first snapshot chunk as its current incarnation."""
        with self._lock:
            old = self._workers.get(record.worker_id)
            if old is not None:
                self._drop_incarnation(old)
            rec = _Incarnation(
                inc=next(self._ids), worker_id=record.worker_id, epoch=record.epoch, endpoint=record.endpoint,
                fingerprint=record.fingerprint, compat=record.fingerprint.compat_key(), kind=record.kind,
                registered_at_ms=record.registered_at_ms,
                expires_at=self._clock() + record.lease_expires_in_ms / 1000,
                last_seq=record.last_seq, load=record.load,
            )
            self._incs[rec.inc] = rec
            self._workers[rec.worker_id] = rec
            self._add(rec, hashes)

    def extend(self, record: WorkerRecord, hashes: Iterable[bytes]) -> bool:
        """Add a later snapshot chunk; False when the worker has moved to another incarnation since."""
        with self._lock:
            rec = self._workers.get(record.worker_id)
            if rec is None or (rec.epoch, rec.registered_at_ms) != (record.epoch, record.registered_at_ms):
                return False
            self._add(rec, hashes)
            return True

    def replay(self, req: Any) -> bool:
        """Apply one write a server applied; False when this copy cannot (it has drifted: resync).

        A write older than what the copy holds — the snapshot already shows it —
        is skipped: a batch whose ``seq`` is not past the worker's last, or any
        write for an epoch older than the worker's current one.
        """
        if isinstance(req, DrainWorker):
            self._ignored.discard(req.worker_id)
            self.drain_worker(req.worker_id)
            return True
        if self.compat_key is not None:
            if isinstance(req, RegisterWorker):
                with self._lock:
                    rec = self._workers.get(req.worker_id)
                if rec is not None and rec.epoch > req.epoch:
                    return True  # older than what the copy holds
                if req.fingerprint.compat_key() != self.compat_key:
                    self._ignored.add(req.worker_id)
                    self.drain_worker(req.worker_id)  # its earlier incarnation of this layout goes
                    return True
                self._ignored.discard(req.worker_id)
            elif req.worker_id in self._ignored:
                return True
        with self._lock:
            rec = self._workers.get(req.worker_id)
            live = rec is not None and self._live(rec)
            if live and rec.epoch > req.epoch:
                return True
            if isinstance(req, Events) and live and rec.epoch == req.epoch and req.seq <= rec.last_seq:
                return True
        if isinstance(req, RegisterWorker):
            try:
                self.register_worker(req)
            except StaleEpoch:
                return False
            return True
        if isinstance(req, Heartbeat):
            return self.heartbeat(req).status == "ok"
        if isinstance(req, Events):
            return self.apply_events(req).status == "ok"
        if isinstance(req, Resync):
            return self.resync(req).status == "ok"
        raise TypeError(f"not a feed write: {type(req).__name__}")
