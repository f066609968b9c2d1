"""Typed client for the registry server: one method per message, with a failover list.

``endpoint`` names one server or several, comma-separated (or a sequence):
servers in front of one store (:mod:`remote_g2.rpc.endpoint_list`). A call goes
to the server in use; when it does not answer (:class:`RpcTimeout`) or its
connection fails, the call is sent again to the next server, each with the
full timeout, and that one stays in use.

A dead server is left at once, not after a timeout: every connection
heartbeats and is watched (:mod:`remote_g2.rpc.connection_watch`). A call whose
connection is lost while it waits (the server was killed: the kernel closed
it; or it stopped answering heartbeats for ``heartbeat_s``: it hangs) moves
to the next server at once; so does a call to a server whose connection is
known to be down, or that refuses the connection, while another server is
left to try (the last one is waited for, as a server being started may
still answer).

Every registry call may be sent twice: a repeated event batch is answered by
sequence number (``resync_needed``, and the publisher resyncs: a batch the
dead server applied is never applied twice, one it did not is never lost),
a repeated registration is a renewal, a resync is restarted from its first
chunk, lookups and heartbeats change nothing twice.

Thread-safe (calls are serialised on one socket per server; see
:class:`remote_g2.rpc.client.RpcClient`). Errors: :class:`RpcTimeout` when
no server answers, :class:`StoreUnavailable` when one answers but its store
does not (another server of the same store would not do better: not a
reason to move), :class:`StaleEpoch` on a refused registration.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from remote_g2.rpc.connection_watch import Liveness
from remote_g2.rpc.curve import CurveClientConfig
from remote_g2.rpc.endpoint_list import EndpointRotation
from remote_g2.errors import RpcClosed, TransportError
from remote_g2.protocol.messages import (
    BlockEvent, DrainWorker, DrainWorkerReply, Events, EventsReply, FeedInfo, FeedInfoReply, Heartbeat,
    HeartbeatReply, LayoutFingerprint, ListWorkers, Lookup, LookupReply, Ping, Pong, RegisterWorker,
    RegisterWorkerReply, Resync, ResyncReply, ScanWorker, ScanWorkerReply, Stats, StatsReply, WhoHas, WorkerInfo,
    WorkerRecord,
)
from remote_g2.rpc.client import RpcClient

__all__ = ["RegistryClient"]

log = logging.getLogger("remote_g2.registry")


class RegistryClient:
    """Calls the registry at ``endpoint`` (one server, or a failover list) with a default timeout of ``timeout_s``.

    ``heartbeat_s``: a server that stops answering ZMTP heartbeats for that long is left (None:
    ``REMOTE_G2_REGISTRY_HEARTBEAT_S``, else 1 s; :class:`~remote_g2.rpc.connection_watch.Liveness`).
    """

    def __init__(self, endpoint: str | Sequence[str], *, timeout_s: float = 5.0,
                 curve: CurveClientConfig | None = None, heartbeat_s: float | None = None) -> None:
        self._servers = EndpointRotation(endpoint)
        self._timeout_ms = timeout_s * 1000.0
        self._curve = curve
        self._liveness = Liveness.from_env(heartbeat_s)
        self._clients: dict[str, RpcClient] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.failovers = 0  # times a call moved to the next server

    @property
    def endpoint(self) -> str:
        """The server in use."""
        return self._servers.current

    @property
    def endpoints(self) -> list[str]:
        """Every server of the failover list, in order."""
        return list(self._servers.endpoints)

    def _client(self, endpoint: str) -> RpcClient:
        with self._lock:
            if self._closed:
                raise RpcClosed(f"registry client of {', '.join(self.endpoints)} is closed")
            client = self._clients.get(endpoint)
            if client is None:
                client = self._clients[endpoint] = RpcClient(endpoint, timeout_ms=self._timeout_ms, curve=self._curve,
                                                            liveness=self._liveness)
            return client

    def _call(self, request: Any, *, timeout_ms: float | None = None) -> Any:
        """Send ``request`` to the server in use, and to the next ones while none answers (module docstring)."""
        return self._call_moving(request, timeout_ms=timeout_ms)[0]

    def _call_moving(self, request: Any, *, timeout_ms: float | None = None,
                     fail_fast: bool = False) -> tuple[Any, bool]:
        """As :meth:`_call`; also whether the answer came from another server than the one first sent to.
        ``fail_fast``: the last server too is not waited for when its connection is down or refused."""
        endpoint = self._servers.current
        for attempt in range(len(self._servers.endpoints)):
            # While another server is left to try, a connection known to be down (or refused) is not waited for.
            fast = fail_fast or attempt + 1 < len(self._servers.endpoints)
            try:
                return self._client(endpoint).call(request, timeout_ms=timeout_ms, fail_fast=fast), attempt > 0
            except RpcClosed:
                raise
            except TransportError as e:  # no answer, or the connection failed: the next server
                if attempt + 1 == len(self._servers.endpoints):
                    raise
                nxt = self._servers.failed(endpoint)
                self.failovers += 1
                log.warning("registry %s: %s; moving to %s", endpoint, e, nxt)
                endpoint = nxt
        raise AssertionError("unreachable")

    def connection_state(self, endpoint: str | None = None) -> str:
        """``up``, ``down`` or ``unknown`` for ``endpoint`` (None: the server in use); see
        :mod:`remote_g2.rpc.connection_watch`. ``unknown`` for a server not called yet."""
        endpoint = self._servers.current if endpoint is None else endpoint
        with self._lock:
            client = self._clients.get(endpoint)
        return "unknown" if client is None else client.connection_state()

    # -- worker side -------------------------------------------------------------------

    def register_worker(self, worker_id: str, endpoint: str, fingerprint: LayoutFingerprint,
                        epoch: int) -> RegisterWorkerReply:
        reply: RegisterWorkerReply = self._call(RegisterWorker(worker_id, endpoint, fingerprint, epoch))
        return reply

    def heartbeat(self, worker_id: str, epoch: int, load: int = 0) -> HeartbeatReply:
        reply: HeartbeatReply = self._call(Heartbeat(worker_id, epoch, load))
        return reply

    def events(self, worker_id: str, epoch: int, seq: int, events: Sequence[BlockEvent]) -> EventsReply:
        """Apply one batch. Sent again to the next server when the first one fails: if that one had applied
        it, the store's sequence number says so (it expects ``seq + 1``) and the answer is ``ok``, as it
        would have been; the resend is this very batch, so nothing in it is applied twice or lost."""
        reply, moved = self._call_moving(Events(worker_id, epoch, seq, list(events)))
        if moved and reply.status == "resync_needed" and reply.expected_seq == seq + 1:
            return EventsReply("ok", seq + 1, 0)
        assert isinstance(reply, EventsReply)
        return reply

    def resync(self, worker_id: str, epoch: int, seq: int, hashes: Sequence[bytes], *, first: bool,
               last: bool) -> ResyncReply:
        reply: ResyncReply = self._call(Resync(worker_id, epoch, seq, list(hashes), first, last))
        return reply

    # -- target side ---------------------------------------------------------------------

    def lookup(self, hashes: Sequence[bytes], *, requester: str | None = None, compat_key: str | None = None,
               want_all_holders: bool = False, timeout_s: float | None = None) -> LookupReply:
        reply: LookupReply = self._call(
            Lookup(list(hashes), requester, compat_key, want_all_holders),
            timeout_ms=None if timeout_s is None else timeout_s * 1000.0,
        )
        return reply

    # -- admin -----------------------------------------------------------------------------

    def who_has(self, hashes: Sequence[bytes], *, include_dead: bool = False) -> dict[bytes, list[str]]:
        reply = self._call(WhoHas(list(hashes), include_dead))
        return dict(zip(hashes, reply.holders))

    def worker_info(self, worker_id: str) -> WorkerRecord | None:
        worker: WorkerRecord | None = self._call(WorkerInfo(worker_id)).worker
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
        workers: list[WorkerRecord] = self._call(ListWorkers(include_dead)).workers
        return workers

    def stats(self) -> StatsReply:
        reply: StatsReply = self._call(Stats())
        return reply

    def drain_worker(self, worker_id: str) -> DrainWorkerReply:
        reply: DrainWorkerReply = self._call(DrainWorker(worker_id))
        return reply

    # -- mirrors ---------------------------------------------------------------------------

    def feed_info(self, *, timeout_s: float | None = None, fail_fast: bool = False) -> FeedInfoReply:
        """The server's change feed. ``fail_fast``: give up at once on a server whose connection is down or
        refused, even the last one (a mirror that can follow other servers meanwhile)."""
        timeout_ms = None if timeout_s is None else timeout_s * 1000.0
        reply: FeedInfoReply = self._call_moving(FeedInfo(), timeout_ms=timeout_ms, fail_fast=fail_fast)[0]
        return reply

    def scan_worker(self, worker_id: str, cursor: bytes = b"", count: int = 16_384) -> ScanWorkerReply:
        reply: ScanWorkerReply = self._call(ScanWorker(worker_id, cursor, count))
        return reply

    def ping(self) -> Pong:
        reply: Pong = self._call(Ping())
        return reply

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for client in clients:
            client.close()

    def __enter__(self) -> RegistryClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

