"""Serving peers: this instance's primary-tier chunks, pinned for a peer's NIXL READ while its lease lasts.

The holder side of the tier (:mod:`.tier`). A peer asks over RPC, with the
source service's own messages (:class:`~remote_g2.messages.Resolve`,
:class:`~remote_g2.messages.Release`): a row of the primary region is one
"block" (:class:`~remote_g2.messages.BlockLayout` of one opaque slab of the
row's bytes), the region is registered with this process's NIXL agent
(:class:`~source.rank_agent.RankAgent`), and a reply names the rows holding
the asked chunks, in order, for the longest prefix held.

Pins are vLLM's: only the tiering manager may pin a primary chunk, and only
on the scheduler thread, through the ``ParentManager`` it hands the tier in
``serve_external_requests`` each step. So an RPC thread queues the ask and
waits (at most ``wait_s``) for the next step to serve it:
``parent.lookup`` of each key until the first that is not a primary ``HIT``
(a ``MISS`` there is a chunk evicted since it was published: ``on_unheld``),
then ``parent.create_store_job`` of those, which pins them and registers a
job of this tier. The lease ends by a ``release``, or lapses after its TTL;
the job is then reported finished (:meth:`ChunkServer.finished_jobs`) and
the manager unpins the chunks. An ask that no step served in time is
answered ``miss``: the peer recomputes, nothing waits on it.
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

from remote_g2.messages import BlockLayout, RankBlocks, RankInfo, Release, ReleaseReply, Resolve, ResolveReply
from remote_g2.secondary_pool import MemoryRegion

__all__ = ["ChunkServer", "offload_key", "TIER_GROUP"]

log = logging.getLogger("remote_g2.adapters.vllm_tier")

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
    done: threading.Event = field(default_factory=threading.Event)
    given_up: bool = False
    rows: list[int] = field(default_factory=list)
    lease_id: int = 0


@dataclass
class _Lease:
    job_id: int
    ends: float
    chunks: int


class ChunkServer:
    """Resolve/release RPCs over this instance's primary region (see the module docstring).

    ``region_base``/``row_bytes``/``num_rows`` describe the primary region as the tier sees it (its memoryview
    in this process); ``on_ask`` is called from an RPC thread when an ask is queued (the tier wakes the engine).
    """

    def __init__(self, worker_id: str, region_base: int, row_bytes: int, num_rows: int, *, bind: str,
                 wait_s: float = 2.0, max_ttl_ms: int = 30_000, on_ask: Callable[[], None] = lambda: None,
                 on_unheld: Callable[[list[bytes]], None] = lambda hashes: None, source_config: Any = None) -> None:
        from remote_g2.rpc_server import RpcServer
        from remote_g2.source import SourceConfig
        from remote_g2.source.rank_agent import RankAgent

        cfg = source_config if source_config is not None else SourceConfig.from_env()
        self.worker_id = worker_id
        self.row_bytes, self.num_rows, self.region_base = row_bytes, num_rows, region_base
        self.epoch = time.time_ns()
        self.wait_s, self.max_ttl_ms = wait_s, max_ttl_ms
        self._on_ask = on_ask
        self._on_unheld = on_unheld
        self._lock = threading.Lock()
        self._asks: deque[_Ask] = deque()
        self._leases: dict[int, _Lease] = {}
        self._finished: list[Any] = []  # JobResult of leases ended since the last finished_jobs()
        self._ctx_ids = itertools.count(1)
        # While a lease is open its reader may need this agent's progress (UCX emulating a READ over TCP, or
        # wiring up): the fast pace then, the idle one otherwise (source/progress_pace.py).
        self.agent = RankAgent(f"remote-g2-tier-{worker_id}-{secrets.token_hex(4)}",
                               [MemoryRegion(region_base, row_bytes * num_rows)], pace=cfg.progress_pace(),
                               readers=lambda: "new" if self._leases else "none")
        self.agent.start_progress()
        layout = BlockLayout(num_blocks=num_rows, block_bytes=row_bytes, num_layers=1, kv=1, num_kv_heads=1,
                             tokens_per_block=1, head_dim=row_bytes, dtype_bytes=1, order="HND")
        self._info = RankInfo(rank=0, agent_name=self.agent.name, agent_metadata=self.agent.metadata,
                              pool_base=region_base, pool_bytes=row_bytes * num_rows, layout=layout)
        self._rpc = RpcServer(bind, {"resolve": self._resolve, "release": self._release},
                              name=f"tier-{worker_id}", workers=4)
        try:
            self.endpoint = self._rpc.start()
        except BaseException:
            self.agent.close()
            raise
        # Counters, for logs, metrics and tests.
        self.served = self.missed = self.lapsed = self.chunks_served = 0

    # -- RPC threads -------------------------------------------------------------------------------------

    def _resolve(self, req: Resolve, ctx: Any) -> ResolveReply:
        ask = _Ask(list(req.hashes), min(int(req.ttl_ms), self.max_ttl_ms), req.requester)
        with self._lock:
            self._asks.append(ask)
        self._on_ask()
        served = ask.done.wait(self.wait_s)
        with self._lock:
            if not served and not ask.done.is_set():  # no step served it: nothing is pinned for it, ever
                ask.given_up = True
        if not ask.rows:
            return ResolveReply(reason="miss", lease_id=0, matched=0, epoch=self.epoch, expires_in_ms=0)
        known = self.agent.name in req.known_agents
        info = self._info if not known else RankInfo(rank=0, agent_name=self.agent.name, agent_metadata=None,
                                                     pool_base=self._info.pool_base,
                                                     pool_bytes=self._info.pool_bytes, layout=self._info.layout)
        return ResolveReply(reason="ok", lease_id=ask.lease_id, matched=len(ask.rows), epoch=self.epoch,
                            expires_in_ms=ask.ttl_ms, ranks=[RankBlocks(rank=0, block_ids=ask.rows)],
                            metadata=[info])

    def _release(self, req: Release, ctx: Any) -> ReleaseReply:
        return ReleaseReply(released=self._end(req.lease_id, success=True))

    # -- the scheduler thread --------------------------------------------------------------------------------

    def serve(self, parent: Any) -> None:
        """Serve the queued asks through ``parent`` (vLLM's ``ParentManager``, valid for this call only)."""
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
                                                        len(held))
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
        self._lapse()
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def has_work(self) -> bool:
        """Asks wait for a step, or leases are open (they must lapse even if no request ever comes)."""
        with self._lock:
            return bool(self._asks or self._leases)

    def open_leases(self) -> int:
        with self._lock:
            return len(self._leases)

    # -- leases ----------------------------------------------------------------------------------------------

    def _end(self, lease_id: int, *, success: bool) -> bool:
        from vllm.v1.kv_offload.tiering.base import JobResult

        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is None:
                return False
            self._finished.append(JobResult(job_id=lease.job_id, success=success,
                                            transfer_bytes=lease.chunks * self.row_bytes))
        return True

    def _lapse(self) -> None:
        now = time.monotonic()
        with self._lock:
            lapsed = [lid for lid, lease in self._leases.items() if lease.ends <= now]
        for lid in lapsed:
            if self._end(lid, success=False):
                self.lapsed += 1
                log.info("tier lease %d lapsed unreleased: its chunks are unpinned", lid)

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
