"""Typed client for the registry server: one method per message.

Thread-safe (calls are serialised on one socket; see
:class:`remote_g2.rpc_client.RpcClient`). Errors: :class:`RpcTimeout` when
the server does not answer, :class:`StoreUnavailable` when it answers but
Redis does not, :class:`StaleEpoch` on a refused registration.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from remote_g2.curve import CurveClientConfig
from remote_g2.messages import (
    BlockEvent, DrainWorker, DrainWorkerReply, Events, EventsReply, FeedInfo, FeedInfoReply, Heartbeat,
    HeartbeatReply, LayoutFingerprint, ListWorkers, Lookup, LookupReply, Pong, RegisterWorker, RegisterWorkerReply,
    Resync, ResyncReply, ScanWorker, ScanWorkerReply, Stats, StatsReply, WhoHas, WorkerInfo, WorkerRecord,
)
from remote_g2.rpc_client import RpcClient

__all__ = ["RegistryClient"]


class RegistryClient:
    """Calls a registry at ``endpoint`` with a default timeout of ``timeout_s``."""

    def __init__(self, endpoint: str, *, timeout_s: float = 5.0, curve: CurveClientConfig | None = None) -> None:
        self.endpoint = endpoint
        self._rpc = RpcClient(endpoint, timeout_ms=timeout_s * 1000.0, curve=curve)

    # -- worker side -------------------------------------------------------------------

    def register_worker(self, worker_id: str, endpoint: str, fingerprint: LayoutFingerprint,
                        epoch: int) -> RegisterWorkerReply:
        reply: RegisterWorkerReply = self._rpc.call(RegisterWorker(worker_id, endpoint, fingerprint, epoch))
        return reply

    def heartbeat(self, worker_id: str, epoch: int, load: int = 0) -> HeartbeatReply:
        reply: HeartbeatReply = self._rpc.call(Heartbeat(worker_id, epoch, load))
        return reply

    def events(self, worker_id: str, epoch: int, seq: int, events: Sequence[BlockEvent]) -> EventsReply:
        reply: EventsReply = self._rpc.call(Events(worker_id, epoch, seq, list(events)))
        return reply

    def resync(self, worker_id: str, epoch: int, seq: int, hashes: Sequence[bytes], *, first: bool,
               last: bool) -> ResyncReply:
        reply: ResyncReply = self._rpc.call(Resync(worker_id, epoch, seq, list(hashes), first, last))
        return reply

    # -- target side ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, requester: str | None = None, compat_key: str | None = None,
               want_all_holders: bool = False, timeout_s: float | None = None) -> LookupReply:
        reply: LookupReply = self._rpc.call(
            Lookup(list(hashes), requester, compat_key, want_all_holders),
            timeout_ms=None if timeout_s is None else timeout_s * 1000.0,
        )
        return reply

    # -- admin -----------------------------------------------------------------------------

    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> dict[bytes, list[str]]:
        reply = self._rpc.call(WhoHas(list(hashes), include_dead))
        return dict(zip(hashes, reply.holders))

    def worker_info(self, worker_id: str) -> WorkerRecord | None:
        worker: WorkerRecord | None = self._rpc.call(WorkerInfo(worker_id)).worker
        return worker

    def wait_for_blocks(self, worker_id: str, blocks: int, *, timeout_s: float = 10.0,
                        poll_s: float = 0.02) -> int:
        """Poll until the registry lists at least ``blocks`` blocks for ``worker_id`` (publishers batch
        their events), or ``timeout_s`` passes; return the count it lists then (0 for an unknown worker)."""
        deadline = time.monotonic() + timeout_s
        while True:
            worker = self.worker_info(worker_id)
            held = worker.blocks if worker is not None else 0
            if held >= blocks or time.monotonic() >= deadline:
                return held
            time.sleep(poll_s)

    def list_workers(self, *, include_dead: bool = False) -> list[WorkerRecord]:
        workers: list[WorkerRecord] = self._rpc.call(ListWorkers(include_dead)).workers
        return workers

    def stats(self) -> StatsReply:
        reply: StatsReply = self._rpc.call(Stats())
        return reply

    def drain_worker(self, worker_id: str) -> DrainWorkerReply:
        reply: DrainWorkerReply = self._rpc.call(DrainWorker(worker_id))
        return reply

    # -- mirrors ---------------------------------------------------------------------------

    def feed_info(self) -> FeedInfoReply:
        reply: FeedInfoReply = self._rpc.call(FeedInfo())
        return reply

    def scan_worker(self, worker_id: str, cursor: bytes = b"", count: int = 16_384) -> ScanWorkerReply:
        reply: ScanWorkerReply = self._rpc.call(ScanWorker(worker_id, cursor, count))
        return reply

    def ping(self) -> Pong:
        return self._rpc.ping()

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
