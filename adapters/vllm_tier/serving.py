"""Serving peers: this instance's primary-tier chunks, READ by peers under a lease.

The holder side of the tier (:mod:`.tier`). A peer asks over RPC, with the
source service's own messages (:class:`~remote_g2.protocol.messages.Resolve`,
:class:`~remote_g2.protocol.messages.Release`): a row of the primary region is one
"block" (:class:`~remote_g2.protocol.messages.BlockLayout` of one opaque slab of the
row's bytes), the region is registered with this process's NIXL agent
(:class:`~source.rank_agent.RankAgent`), and a reply names the rows holding
the asked chunks, in order, for the longest prefix held. A lease is kept one
of two ways.

**Validated (the default, when the tier sees the primary's evictions).**
Each published chunk's row is known (:meth:`ChunkServer.held`), and each row
has a generation, bumped on the scheduler thread the moment the primary
evicts or removes its chunk (:meth:`ChunkServer.let_go`): before vLLM can
hand the row to another chunk, so before any new byte is written to it. The
RPC thread answers at once, from that map, with no engine step: the lease
notes each row's generation. The reader READs, then releases, and the
release answers ``released: true`` only if no row's generation moved while
the lease was open; otherwise the reader discards those rows (recompute).
Nothing is pinned: a chunk evicted mid-READ is a miss, never wrong bytes.
A lease past its TTL is released ``false``. The same rows are kept in a
:class:`~.chunk_table.ChunkTable` registered beside the region: a reader
whose READs need no progress from this side (a ``cma`` READ on this host,
RDMA across hosts) is granted it after its first release (``chunk_table``)
and finds rows there with one-sided READs, asking nothing.

**Pinned (the fallback, when the evictions cannot be seen).** Only the
tiering manager may pin a primary chunk, and only on the scheduler thread,
through the ``ParentManager`` it hands the tier in
``serve_external_requests`` each step. So an RPC thread queues the ask and
waits (at most ``wait_s``) for the next step to serve it: ``parent.lookup``
of each key until the first that is not a primary ``HIT`` (a ``MISS`` there
is a chunk evicted since it was published: ``on_unheld``), then
``parent.create_store_job`` of those, which pins them and registers a job of
this tier. The lease ends by a ``release``, or lapses after its TTL; the job
is then reported finished (:meth:`ChunkServer.finished_jobs`) and the
manager unpins the chunks. An ask that no step served in time is answered
``miss``: the peer recomputes, nothing waits on it.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

from remote_g2.rpc.connection_identity import is_local
from remote_g2.protocol.messages import (BlockLayout, ChunkTable as ChunkTableAsk, ChunkTableReply, RankBlocks,
                                         RankInfo, Release, ReleaseReply, Resolve, ResolveReply)
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.source.progress_pace import ServedOwners, readers_of

from .chunk_table import SLOT_BYTES, WAYS, ChunkTable

__all__ = ["ChunkServer", "offload_key", "TIER_GROUP"]

log = logging.getLogger("remote_g2.adapters.vllm_tier")

_TABLE_WIRE_UP_S = 2.0  # the fast progress pace after a chunk table is granted (its reader's first READ)

TIER_GROUP = 0  # the KV-cache group whose chunks are shared (identity.py: one group only)


def offload_key(block_hash: bytes, group: int = TIER_GROUP) -> bytes:
    """vLLM's ``OffloadKey`` of a chunk: its block hash, then the group index as 4 big-endian bytes."""
    return bytes(block_hash) + group.to_bytes(4, "big")


@dataclass
class _Ask:
    """One peer's resolve, between its RPC thread and the scheduler thread (under ``ChunkServer._lock``)."""

    hashes: list[bytes]
    ttl_ms: int
    requester: str | None
    owner: bytes
    done: threading.Event = field(default_factory=threading.Event)
    given_up: bool = False
    rows: list[int] = field(default_factory=list)
    lease_id: int = 0


@dataclass
class _Lease:
    """An open lease: the store job pinning its chunks (pinned), or the rows' generations it was answered at
    (validated: ``job_id`` None)."""

    job_id: int | None
    ends: float
    chunks: int
    owner: bytes  # the identity of the connection that took it: only that one may release it
    rows: tuple[int, ...] = ()
    gens: tuple[int, ...] = ()


class ChunkServer:
    """Resolve/release RPCs over this instance's primary region (see the module docstring).

    ``region_base``/``row_bytes``/``num_rows`` describe the primary region as the tier sees it (its memoryview
    in this process); at most ``max_leases`` leases are open at once (an ask past them is a miss). ``validated``:
    leases are validated (the tier calls :meth:`held`, :meth:`let_go` and
    :meth:`let_go_all` as the primary keeps and evicts chunks); otherwise they are pinned, and ``on_ask`` is
    called from an RPC thread when an ask is queued (the tier wakes the engine).
    """

    def __init__(self, worker_id: str, region_base: int, row_bytes: int, num_rows: int, *, bind: str,
                 validated: bool = False, wait_s: float = 2.0, max_ttl_ms: int = 30_000, max_leases: int = 4096,
                 on_ask: Callable[[], None] = lambda: None,
                 on_unheld: Callable[[list[bytes]], None] = lambda hashes: None, source_config: Any = None) -> None:
        from remote_g2.rpc.server import RpcServer
        from remote_g2.source import SourceConfig
        from remote_g2.source.rank_agent import RankAgent

        cfg = source_config if source_config is not None else SourceConfig.from_env()
        self.worker_id = worker_id
        self.row_bytes, self.num_rows, self.region_base = row_bytes, num_rows, region_base
        self.epoch = time.time_ns()
        self.wait_s, self.max_ttl_ms, self.max_leases = wait_s, max_ttl_ms, max_leases
        self._on_ask = on_ask
        self._on_unheld = on_unheld
        self._lock = threading.Lock()
        self._asks: deque[_Ask] = deque()
        self._leases: dict[int, _Lease] = {}
        self._finished: list[Any] = []  # JobResult of leases ended since the last finished_jobs()
        self._ctx_ids = itertools.count(1)
        # Validated leases: chunk hash -> (its row, the row's generation when it was stored); each row's generation.
        # Written on the scheduler thread only, read by RPC threads (a dict get and a list index are atomic).
        self._held: dict[bytes, tuple[int, int]] | None = {} if validated else None
        self._gen = [0] * num_rows
        # ... and the same, READable one-sided by readers whose READs need none of this side's progress.
        self.table = ChunkTable(num_rows) if validated else None
        self._served = ServedOwners()  # connections that released a lease (_readers)
        self._wiring_until = 0.0  # a chunk table was just granted: a reader's first READ of it is wiring up
        # While a lease is open its reader may need this agent's progress (UCX emulating a READ over TCP, or
        # wiring up): the fast pace then, the idle one otherwise (source/progress_pace.py).
        self._pace = cfg.progress_pace()
        regions = [MemoryRegion(region_base, row_bytes * num_rows)]
        if self.table is not None:
            regions.append(MemoryRegion(self.table.base, self.table.nbytes))
        self.agent = RankAgent(f"remote-g2-tier-{worker_id}-{secrets.token_hex(4)}", regions, pace=self._pace,
                               readers=self._readers)
        self.agent.start_progress()
        layout = BlockLayout(num_blocks=num_rows, block_bytes=row_bytes, num_layers=1, kv=1, num_kv_heads=1,
                             tokens_per_block=1, head_dim=row_bytes, dtype_bytes=1, order="HND")
        self._info = RankInfo(rank=0, agent_name=self.agent.name, agent_metadata=self.agent.metadata,
                              pool_base=region_base, pool_bytes=row_bytes * num_rows, layout=layout)
        # A validated ask is answered without waiting: one thread owning the socket answers it with no hand-off.
        # A pinned one waits for a step, so a pool keeps the others answered meanwhile.
        self._rpc = RpcServer(bind, {"resolve": self._resolve, "release": self._release,
                                     "chunk_table": self._chunk_table},
                              name=f"tier-{worker_id}", workers=1 if validated else 4, identify_clients=True)
        try:
            self.endpoint = self._rpc.start()
        except BaseException:
            self.agent.close()
            raise
        # Counters, for logs, metrics and tests.
        self.served = self.missed = self.lapsed = self.chunks_served = 0

    # -- RPC threads -------------------------------------------------------------------------------------

    def _resolve(self, req: Resolve, ctx: Any) -> ResolveReply:
        ttl_ms = min(int(req.ttl_ms), self.max_ttl_ms)
        owner = ctx.identity or b""
        with self._lock:
            full = len(self._leases) + len(self._asks) >= self.max_leases
            if full:  # (leases past their TTL count until swept: sweep only here, not on every ask)
                self._sweep()
                full = len(self._leases) + len(self._asks) >= self.max_leases
            if full:
                self.missed += 1
        if full:  # (readers that never release: the holder's memory and pins stay bounded)
            rows, lease_id = [], 0
        elif self._held is not None:
            rows, lease_id = self._lease_validated(req.hashes, ttl_ms, owner)
        else:
            rows, lease_id = self._lease_pinned(req, ttl_ms, owner)
        if not rows:
            return ResolveReply(reason="miss", lease_id=0, matched=0, epoch=self.epoch, expires_in_ms=0)
        known = self.agent.name in req.known_agents
        info = self._info if not known else RankInfo(rank=0, agent_name=self.agent.name, agent_metadata=None,
                                                     pool_base=self._info.pool_base,
                                                     pool_bytes=self._info.pool_bytes, layout=self._info.layout)
        return ResolveReply(reason="ok", lease_id=lease_id, matched=len(rows), epoch=self.epoch,
                            expires_in_ms=ttl_ms, ranks=[RankBlocks(rank=0, block_ids=rows)], metadata=[info])

    def _lease_validated(self, hashes: list[bytes], ttl_ms: int, owner: bytes) -> tuple[list[int], int]:
        """The rows of the longest held prefix of ``hashes``, leased at their generations now (no step waited)."""
        held, gen = self._held, self._gen
        assert held is not None
        rows: list[int] = []
        gens: list[int] = []
        for h in hashes:
            entry = held.get(h)
            if entry is None or gen[entry[0]] != entry[1]:  # never stored here, or evicted since
                break
            rows.append(entry[0])
            gens.append(entry[1])
        with self._lock:
            if not rows:
                self.missed += 1
                return [], 0
            lease_id = secrets.randbits(62) + 1
            self._leases[lease_id] = _Lease(None, time.monotonic() + ttl_ms / 1000, len(rows), owner, tuple(rows),
                                            tuple(gens))
            self.served += 1
            self.chunks_served += len(rows)
        self.agent.wake()  # (its progress pace: a reader is coming)
        return rows, lease_id

    def _lease_pinned(self, req: Resolve, ttl_ms: int, owner: bytes) -> tuple[list[int], int]:
        """Queue the ask for the next step's :meth:`serve` and wait for it (at most ``wait_s``)."""
        ask = _Ask(list(req.hashes), ttl_ms, req.requester, owner)
        with self._lock:
            self._asks.append(ask)
        self._on_ask()
        served = ask.done.wait(self.wait_s)
        with self._lock:
            if not served and not ask.done.is_set():  # no step served it: nothing is pinned for it, ever
                ask.given_up = True
        return ask.rows, ask.lease_id

    def _release(self, req: Release, ctx: Any) -> ReleaseReply:
        return ReleaseReply(released=self._end(req.lease_id, success=True, owner=ctx.identity or b""))

    def _chunk_table(self, req: ChunkTableAsk, ctx: Any) -> ChunkTableReply:
        """Where the chunk table is, for a connection whose READs need none of this side's progress: past its
        wire-up (it released a lease here), and one-sided (``cma`` on this host; RDMA-only ``UCX_TLS`` across)."""
        owner = ctx.identity or b""
        if self.table is None:
            return ChunkTableReply(granted=False, reason="pinned leases only")
        with self._lock:
            served = owner in self._served
        if not served:
            return ChunkTableReply(granted=False, reason="no lease released yet")
        if not self._pace.one_sided(is_local(owner)):
            return ChunkTableReply(granted=False, reason="reads need the holder's progress")
        # A reader's first small READ of the table wires up another UCX protocol than its READs of whole rows did,
        # and that needs this side's progress once: the fast pace for a moment, in which the reader READs a slot.
        with self._lock:
            self._wiring_until = time.monotonic() + _TABLE_WIRE_UP_S
        self.agent.wake()
        return ChunkTableReply(granted=True, agent_name=self.agent.name, epoch=self.epoch, base=self.table.base,
                               buckets=self.table.buckets, ways=WAYS, slot_bytes=SLOT_BYTES)

    # -- validated leases: the chunks held, and their rows' generations (scheduler thread) ------------------------

    def held(self, hashes: list[bytes], rows: list[int]) -> None:
        """These chunks are complete in the primary tier, in these rows (the tier's ``submit_store``)."""
        if self._held is not None and self.table is not None:
            for h, row in zip(hashes, rows):
                self._held[h] = (row, self._gen[row])
                self.table.put(h, row)

    def let_go(self, hashes: list[bytes]) -> None:
        """These chunks left the primary tier (evicted, removed): their rows' open leases fail validation.

        Called before vLLM hands a row to another chunk: the generation moves before any new byte is written."""
        if self._held is None or self.table is None:
            return
        for h in hashes:
            entry = self._held.get(h)
            if entry is not None:
                self._gen[entry[0]] += 1  # (first: an RPC thread that still finds the entry sees it is stale)
                del self._held[h]
            self.table.drop(h)  # (one-sided readers: the slot's version moves)

    def let_go_all(self) -> None:
        """The primary tier was reset: every row changes."""
        if self._held is None or self.table is None:
            return
        for row in range(self.num_rows):
            self._gen[row] += 1
        self._held.clear()
        self.table.clear()

    # -- the scheduler thread --------------------------------------------------------------------------------

    def serve(self, parent: Any) -> None:
        """Serve the queued asks through ``parent`` (vLLM's ``ParentManager``, valid for this call only)."""
        if not self._asks and not self._leases:  # (every step: nothing to do is the common case; an ask queued
            return                               # just after this look is served at the next step)
        from vllm.v1.kv_offload.base import LookupResult, ReqContext

        self._lapse()
        while True:
            with self._lock:
                if not self._asks:
                    return
                ask = self._asks.popleft()
                if ask.given_up:
                    continue
            ctx = ReqContext(req_id=f"remote-g2-tier:{ask.requester or '?'}:{next(self._ctx_ids)}")
            parent.on_new_request(ctx)
            try:
                held = []
                for h in ask.hashes:
                    found = parent.lookup(offload_key(h), ctx)
                    if found != LookupResult.HIT:  # (HIT_PENDING: coming from another tier, not in primary yet)
                        if found == LookupResult.MISS:
                            self._on_unheld([h])  # published, since evicted: the registry forgets it
                        break
                    held.append(offload_key(h))
                job = None
                with self._lock:
                    if held and not ask.given_up:
                        job = parent.create_store_job(held, ctx)  # pins them until the job is reported
                        lease_id = secrets.randbits(62) + 1
                        self._leases[lease_id] = _Lease(job.job_id, time.monotonic() + ask.ttl_ms / 1000,
                                                        len(held), ask.owner)
                        ask.rows, ask.lease_id = [int(c) for c in job.chunk_ids], lease_id
                    ask.done.set()
                if job is not None:
                    self.served += 1
                    self.chunks_served += len(held)
                    self.agent.wake()
                else:
                    self.missed += 1
            finally:
                parent.on_request_finished(ctx)

    def finished_jobs(self) -> list[Any]:
        """The store jobs of leases ended (released, lapsed) since the last call: the manager unpins them."""
        if not self._leases and not self._finished:  # (every step; see serve)
            return []
        self._lapse()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def has_work(self) -> bool:
        """Asks wait for a step, or pinned leases are open (they must lapse even if no request ever comes).
        Validated leases need no step."""
        with self._lock:
            return bool(self._asks) or any(lease.job_id is not None for lease in self._leases.values())

    def open_leases(self) -> int:
        if not self._leases:  # (the tier's stats ask every step)
            return 0
        with self._lock:
            self._sweep()
            return len(self._leases)

    # -- leases ----------------------------------------------------------------------------------------------

    def _end(self, lease_id: int, *, success: bool, owner: bytes | None = None) -> bool:
        """End a lease; whether what was read under it stands (it was open, and, if validated, intact). With
        ``owner`` (a release), a lease another connection took is left alone and answered False."""
        with self._lock:
            lease = self._leases.get(lease_id)
            if lease is None or (owner is not None and lease.owner != owner):
                return False
            del self._leases[lease_id]
            if owner is not None:
                self._served.add(owner)
            if lease.job_id is not None:
                from vllm.v1.kv_offload.tiering.base import JobResult  # (pinned leases only: vLLM's manager)

                self._finished.append(JobResult(job_id=lease.job_id, success=success,
                                                transfer_bytes=lease.chunks * self.row_bytes))
                return True
        gen = self._gen
        if time.monotonic() > lease.ends:  # lapsed, not yet swept: past its TTL a lease is not honoured
            return False
        return all(gen[row] == g for row, g in zip(lease.rows, lease.gens))

    def _lapse(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._sweep()
            lapsed = [lid for lid, lease in self._leases.items() if lease.ends <= now]
        for lid in lapsed:
            if self._end(lid, success=False):
                self.lapsed += 1
                log.info("tier lease %d lapsed unreleased: its chunks are unpinned", lid)

    def _sweep(self) -> None:
        """Drop validated leases past their TTL (nothing was pinned for them: no step is needed). Under the lock."""
        now = time.monotonic()
        for lid in [lid for lid, lease in self._leases.items() if lease.job_id is None and lease.ends <= now]:
            del self._leases[lid]
            self.lapsed += 1

    def _readers(self) -> str:
        """Who holds the open leases, for the agent's progress pace (source/progress_pace.py, as the source
        service's lease table says it): ``none``; ``new`` (a connection that has not released a lease here yet:
        its first READ may still be wiring UCX up, which needs this side's progress); ``local`` (readers on this
        host only: one-sided ``cma`` READs need none); ``remote``."""
        with self._lock:
            self._sweep()
            if time.monotonic() < self._wiring_until:
                return "new"
            return readers_of({lease.owner for lease in self._leases.values()}, self._served)

    def close(self) -> None:
        """Stop answering, end every lease (reported by a last :meth:`finished_jobs`), drop the agent."""
        self._rpc.close()
        with self._lock:
            for ask in self._asks:
                ask.given_up = True
                ask.done.set()
            self._asks.clear()
            ids = list(self._leases)
        for lid in ids:
            self._end(lid, success=False)
        self.agent.close()
