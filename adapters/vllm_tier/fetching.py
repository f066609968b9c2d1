"""Loading chunks from peers: resolve at the holder, NIXL READ into the primary rows vLLM assigned, release.

The reader side of the tier (:mod:`.tier`). vLLM's tiering manager hands
``submit_load`` a job: the chunk keys, and for each a row of this instance's
primary region reserved for it. Each job runs on this module's one thread,
never on the scheduler's:

1. the keys, in order, in runs by holder (the one the tier's lookup chose);
2. per run, a ``resolve`` RPC to the holder's :class:`~.serving.ChunkServer`:
   it leases the longest prefix it still holds and names their rows;
3. one NIXL READ of those rows into the reserved ones (one descriptor per
   run of rows contiguous on both sides), polled to its end;
4. the ``release`` of the lease, whose answer says whether the rows stayed
   the chunks' own while it was open (a validated lease: no row evicted
   meanwhile; a pinned one: not lapsed);
5. the job's result: every key read, or which ones were (partial success).
   A lease whose READ failed is released after the result, off its path.

Steps 2 to 4 take two RPCs, each a few thread wake-ups on both sides. After
a first release at a holder, this thread asks it for its chunk table
(:mod:`.chunk_table`), off any job's path; where the holder grants it (this
reader's READs need none of its progress), later runs find their rows with
one-sided READs instead: the chunks' buckets, the rows, the rows' slots
again (a chunk counts only if its slot did not change meanwhile). Chunks the
table does not have go on over RPC; a failed one-sided READ drops the table
until the next RPC fetch asks for it again.

While a job is queued or runs, the interpreter's switch interval is lowered
(:class:`QuickHandoff`): the engine core's loop keeps stepping, in Python,
while a request waits for its KV, and each time this thread blocks (an RPC's
reply, a READ) it waits that long for the GIL back once the reply is in
(Python's default, 5 ms, made a fetch several times slower:
docs/benchmarks.md, "remote-g2 as a vLLM tier").

A key is reported read only when its READ completed ``done`` within half the
lease's TTL and its release answered ``released`` (or, one-sided, within
``timeout_s`` and its slot unchanged): a holder that died, a lease that
lapsed, a chunk evicted before the resolve or during the READ all fail that
key, and vLLM recomputes it. Nothing here waits without a deadline.
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from remote_g2.errors import RemoteG2Error
from remote_g2.protocol.messages import ChunkTable, Release, Resolve
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.source.progress_pace import cma_usable, local_reads_one_sided, reads_need_source

from .chunk_table import SLOT_BYTES, bucket_of, digest_of, find_in_buckets, slot_dtype

__all__ = ["ChunkFetcher", "LoadRun", "QuickHandoff"]

log = logging.getLogger("remote_g2.adapters.vllm_tier")

_SPIN_S = 0.002  # a READ is polled without a pause this long (most end within it), then every 0.2 ms
_TABLE_CHUNKS = 512  # chunks a one-sided lookup takes at once (the rest of a run: the next lookup, or RPC)
_TABLE_BUCKET_MAX = 1024  # the largest bucket (ways x slot bytes) a reader takes from a holder


_TABLE_BUCKETS_MAX = 1 << 18  # the most buckets of a holder's table this reader prepares (a holder of 128k rows)


@dataclass(frozen=True)
class _Table:
    """A holder's chunk table, as its ``chunk_table`` reply and its last resolve reply said, with the NIXL lists
    prepared for it: every bucket of the table (``buckets``), and two sets of ``_TABLE_CHUNKS`` bucket-sized
    places in the scratch region (``landing``: the lookup's, then the validation's)."""

    agent: str
    base: int
    buckets: int
    ways: int
    pool_base: int
    num_rows: int
    remote: Any  # adapters.nixl_transfer.Prepared
    landing: Any


class QuickHandoff:
    """A span in which the interpreter's switch interval is at most ``interval_s``: the first :meth:`enter` lowers
    it, the last :meth:`leave` restores what it was (unless someone else changed it meanwhile); the two may come
    from different threads. Also a context manager. ``interval_s`` 0: no change."""

    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._inside = 0
        self._saved: float | None = None

    def enter(self) -> None:
        with self._lock:
            self._inside += 1
            if self._inside == 1 and self.interval_s > 0 and sys.getswitchinterval() > self.interval_s:
                self._saved = sys.getswitchinterval()
                sys.setswitchinterval(self.interval_s)

    def leave(self) -> None:
        with self._lock:
            self._inside -= 1
            if self._inside == 0 and self._saved is not None:
                if abs(sys.getswitchinterval() - self.interval_s) < 1e-9:  # (set by us, not since by another)
                    sys.setswitchinterval(self._saved)
                self._saved = None

    def __enter__(self) -> None:
        self.enter()

    def __exit__(self, *exc: object) -> None:
        self.leave()


@dataclass(frozen=True)
class LoadRun:
    """Consecutive keys of one job that one holder serves: their registry hashes and the rows they land in."""

    endpoint: str
    keys: list[bytes]
    hashes: list[bytes]
    rows: list[int]


def coalesce(local: list[int], remote: list[int], row_bytes: int, local_base: int,
             remote_base: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Extents ``(local addr, remote addr, length)`` for row pairs, a run of rows contiguous on both sides in one."""
    lo: list[int] = []
    ro: list[int] = []
    ln: list[int] = []
    for a, b in zip(local, remote):
        if ln and lo[-1] + ln[-1] == local_base + a * row_bytes and ro[-1] + ln[-1] == remote_base + b * row_bytes:
            ln[-1] += row_bytes
        else:
            lo.append(local_base + a * row_bytes)
            ro.append(remote_base + b * row_bytes)
            ln.append(row_bytes)
    return np.asarray(lo, np.uint64), np.asarray(ro, np.uint64), np.asarray(ln, np.uint64)


class ChunkFetcher:
    """Runs load jobs on one thread (see the module docstring); results through :meth:`results`."""

    def __init__(self, worker_id: str, region_base: int, row_bytes: int, num_rows: int, *,
                 timeout_s: float = 5.0, lease_ttl_ms: int = 10_000, rpc_timeout_ms: float = 2_000,
                 switch_interval_s: float = 0.0005) -> None:
        from remote_g2.adapters.nixl_transfer import NixlTransfer

        self.worker_id = worker_id
        self.region_base, self.row_bytes, self.num_rows = region_base, row_bytes, num_rows
        self.timeout_s, self.lease_ttl_ms, self.rpc_timeout_ms = timeout_s, lease_ttl_ms, rpc_timeout_ms
        self.transfer = NixlTransfer(f"remote-g2-tier-reader-{worker_id}-{secrets.token_hex(4)}")
        # Where one-sided lookups land: the buckets of a run's chunks, then their slots again.
        self._scratch = np.zeros(2 * _TABLE_CHUNKS * _TABLE_BUCKET_MAX, np.uint8)
        self.transfer.register_local([MemoryRegion(region_base, row_bytes * num_rows),
                                      MemoryRegion(self._scratch.ctypes.data, self._scratch.nbytes)])
        self._jobs: queue.Queue[tuple[int, list[LoadRun]] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._results: list[Any] = []
        self._busy = 0  # jobs queued or running
        self._idle = threading.Condition(self._lock)
        self._clients: dict[str, Any] = {}
        self._agents: dict[str, str] = {}  # holder endpoint -> its NIXL agent, once loaded
        self._last_info: dict[str, Any] = {}  # holder endpoint -> the RankInfo of its last resolve reply
        self._tables: dict[str, _Table] = {}  # holder endpoint -> its chunk table, where it granted one
        self._table_asked: set[str] = set()  # endpoints asked (or to ask, after the job) for their table
        tls = os.environ.get("UCX_TLS")
        self._one_sided_ok = not reads_need_source(tls) or local_reads_one_sided(tls, cma_usable())
        self._closed = False
        self._handoff = QuickHandoff(switch_interval_s)
        self._thread = threading.Thread(target=self._run, name=f"remote-g2-tier-fetch-{worker_id}", daemon=True)
        self._thread.start()
        # Counters, for logs, metrics and tests; the last jobs' (chunks read, seconds in all, resolving, READing).
        self.chunks_read = self.chunks_failed = 0
        self.chunks_read_one_sided = 0  # of chunks_read, found through a holder's chunk table (no RPC)
        self.recent: deque[tuple[int, float, float, float]] = deque(maxlen=1024)
        self.unreported: deque[float] = deque(maxlen=4096)  # fetch seconds not yet in the tier's stats

    def submit(self, job_id: int, runs: list[LoadRun]) -> None:
        """Queue a job (from the scheduler thread: returns at once). The switch interval is lowered from here, so
        that the fetch thread, woken by the queue, gets the GIL soon too."""
        with self._lock:
            self._busy += 1
        self._handoff.enter()  # (left by the fetch thread once the job is done)
        self._jobs.put((job_id, runs))

    def results(self) -> list[Any]:
        """``JobResult`` of the jobs ended since the last call."""
        if not self._results:  # (every step; see the tier's get_finished_jobs)
            return []
        with self._lock:
            out, self._results = self._results, []
        return out

    def busy(self) -> bool:
        with self._lock:
            return self._busy > 0

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every submitted job has ended (its result queued); False if ``timeout_s`` passed first."""
        with self._lock:
            return self._idle.wait_for(lambda: self._busy == 0, timeout_s)

    def close(self) -> None:
        """Finish the queued jobs (each ends within its deadline), then release the agent and the clients."""
        if self._closed:
            return
        self._closed = True
        self._jobs.put(None)
        self._thread.join(self.timeout_s * 4 + 5)
        for client in self._clients.values():
            client.close()
        self._clients.clear()
        self.transfer.close()

    # -- the fetch thread ----------------------------------------------------------------------------

    def _run(self) -> None:
        while (item := self._jobs.get()) is not None:
            try:
                self._job(*item)
            finally:
                self._handoff.leave()  # (entered by submit)

    def _job(self, job_id: int, runs: list[LoadRun]) -> None:
        from vllm.v1.kv_offload.tiering.base import JobResult

        t0 = time.perf_counter()
        ok: list[bytes] = []
        leases: list[tuple[str, int]] = []
        wanted = sum(len(r.keys) for r in runs)
        phases = [0.0, 0.0]  # seconds resolving (the RPC; a pinned lease waits for the holder's step), READing
        for run in runs:
            try:
                ok += self._load_run(run, leases, phases)
            except Exception as e:  # a holder gone, a bad answer, a failed READ: those keys are recomputed
                log.info("tier fetch of %d chunks from %s failed: %s", len(run.keys), run.endpoint, e)
        self.chunks_read += len(ok)
        self.chunks_failed += wanted - len(ok)
        seconds = time.perf_counter() - t0
        self.recent.append((len(ok), seconds, phases[0], phases[1]))
        self.unreported.append(seconds)  # (the tier's metrics take them)
        result = JobResult(job_id=job_id, success=len(ok) == wanted,
                           successful_keys=None if len(ok) == wanted else ok,
                           transfer_time=seconds, transfer_bytes=len(ok) * self.row_bytes)
        with self._lock:
            self._results.append(result)
            self._busy -= 1
            self._idle.notify_all()
        # Leases whose READ failed are given back after the result, off its critical path.
        for endpoint, lease_id in leases:
            try:
                self._client(endpoint).call(Release(lease_id), fail_fast=True)
            except Exception as e:  # the lease lapses at the holder on its own
                log.debug("tier release at %s failed: %s", endpoint, e)
        for run in runs:  # holders whose lease this connection released for the first time: where is their table?
            if run.endpoint in self._last_info and run.endpoint not in self._table_asked:
                self._table_asked.add(run.endpoint)
                self._ask_table(run.endpoint)

    def _client(self, endpoint: str) -> Any:
        from remote_g2.rpc.client import RpcClient

        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = RpcClient(endpoint, timeout_ms=self.rpc_timeout_ms)
        return client

    def _load_run(self, run: LoadRun, leases: list[tuple[str, int]], phases: list[float]) -> list[bytes]:
        """READ what the holder still holds of ``run``; the keys read (a prefix of ``run.keys``): through the
        holder's chunk table where it granted one (:meth:`_load_one_sided`), the rest over RPC
        (:meth:`_load_leased`). The time spent goes to ``phases``."""
        if not run.endpoint:
            raise RemoteG2Error("no holder known for these chunks (their lookup's answer was dropped)")
        table = self._tables.get(run.endpoint)
        if table is None:
            return self._load_leased(run, leases, phases)
        try:
            got = self._load_one_sided(run, table, phases)
        except Exception:
            self._forget_holder(run.endpoint)  # (a holder restarted or gone: ask it anew, over RPC)
            raise
        self.chunks_read_one_sided += len(got)
        if len(got) == len(run.keys):
            return got
        n = len(got)  # the rest: not in the table (evicted, its bucket full, past one lookup): ask over RPC
        rest = LoadRun(run.endpoint, run.keys[n:], run.hashes[n:], run.rows[n:])
        return got + self._load_leased(rest, leases, phases)

    def _load_one_sided(self, run: LoadRun, table: _Table, phases: list[float]) -> list[bytes]:
        """Find the rows of ``run``'s chunks in the holder's chunk table, READ them, and READ their buckets again:
        the keys whose slots did not change meanwhile (a prefix; chunk_table.py's seqlock). No RPC."""
        started = time.monotonic()
        deadline = started + self.timeout_s
        n = min(len(run.hashes), _TABLE_CHUNKS)
        digests = [digest_of(h) for h in run.hashes[:n]]
        buckets = np.asarray([bucket_of(d, table.buckets) for d in digests], np.int64)
        t = self.transfer
        self._finish(t.start_read_prepared(table.landing, np.arange(n), table.remote, buckets, not_after=deadline),
                     deadline, run.endpoint)
        bucket_bytes = table.ways * SLOT_BYTES
        seen = self._scratch[:n * bucket_bytes].view(slot_dtype).reshape(n, table.ways)
        found: list[tuple[int, int, int]] = []  # (way, version, row) of the chunks found, in order
        for hit in find_in_buckets(seen, digests):
            if hit is None or not 0 <= hit[2] < table.num_rows:
                break
            found.append(hit)
        looked = time.monotonic()
        phases[0] += looked - started
        if not found:
            return []
        k = len(found)
        local, remote, nbytes = coalesce(run.rows[:k], [row for _, _, row in found], self.row_bytes,
                                         self.region_base, table.pool_base)
        self._finish(t.start_read(table.agent, local, remote, nbytes, not_after=deadline), deadline, run.endpoint)
        self._finish(t.start_read_prepared(table.landing, np.arange(_TABLE_CHUNKS, _TABLE_CHUNKS + k), table.remote,
                                           buckets[:k], not_after=deadline), deadline, run.endpoint)
        phases[1] += time.monotonic() - looked
        again_at = _TABLE_CHUNKS * bucket_bytes
        again = self._scratch[again_at:again_at + k * bucket_bytes].view(slot_dtype).reshape(k, table.ways)
        good = 0
        for i, (way, version, row) in enumerate(found):
            if int(again[i, way]["version"]) != version or int(again[i, way]["row"]) != row:
                break  # evicted (or moved) since it was found: this chunk and the rest are recomputed
            good += 1
        return run.keys[:good]

    def _finish(self, handle: Any, deadline: float, endpoint: str) -> None:
        """Poll a READ to its end and release it; raises unless it ended ``done`` before ``deadline``."""
        t = self.transfer
        try:
            spin_until = time.monotonic() + _SPIN_S
            while (state := t.poll(handle)) == "pending":
                now = time.monotonic()
                if now > deadline:
                    raise RemoteG2Error(f"READ from {endpoint} not done within its deadline")
                if now > spin_until:  # a READ this long is not one more poll away: stop spinning a core on it
                    time.sleep(0.0002)
        finally:
            t.release(handle)
        if state != "done" or time.monotonic() > deadline:
            raise RemoteG2Error(f"READ from {endpoint} ended {state!r}")

    def _ask_table(self, endpoint: str) -> None:
        """Ask a holder where its chunk table is (after a job's result: off its path); kept where granted. Not
        asked where this process's own ``UCX_TLS`` leaves it no one-sided READ (the holder judges by its own)."""
        if not self._one_sided_ok:
            return
        info = self._last_info.get(endpoint)
        try:
            reply = self._client(endpoint).call(ChunkTable(self.worker_id), fail_fast=True)
        except Exception as e:  # a holder without one (an older version answers ERR): RPC it stays
            log.debug("tier: %s has no chunk table for us: %s", endpoint, e)
            return
        if not reply.granted or info is None or reply.agent_name != info.agent_name:
            log.debug("tier: %s gives no chunk table: %s", endpoint, reply.reason or "another agent")
            return
        if reply.slot_bytes != SLOT_BYTES or not 1 <= reply.ways * SLOT_BYTES <= _TABLE_BUCKET_MAX \
                or reply.buckets < 1 or reply.buckets & (reply.buckets - 1):
            log.info("tier: %s's chunk table has a layout this reader does not take (%d ways of %d bytes, %d "
                     "buckets): resolving over RPC", endpoint, reply.ways, reply.slot_bytes, reply.buckets)
            return
        if reply.buckets > _TABLE_BUCKETS_MAX:
            log.info("tier: %s's chunk table has %d buckets, more than this reader prepares: resolving over RPC",
                     endpoint, reply.buckets)
            return
        t = self.transfer
        bucket_bytes = reply.ways * SLOT_BYTES
        remote = landing = None
        try:
            # Prepared once: a small READ that builds its descriptor lists and request from scratch costs several
            # times more, on a core that was idle (the fetch thread's, as a job starts).
            every = np.arange(reply.buckets, dtype=np.uint64)
            remote = t.prepare(reply.agent_name, reply.base + every * bucket_bytes,
                               np.full(reply.buckets, bucket_bytes, np.uint64))
            landing = t.prepare(None, self._scratch.ctypes.data + np.arange(2 * _TABLE_CHUNKS, dtype=np.uint64)
                                * bucket_bytes, np.full(2 * _TABLE_CHUNKS, bucket_bytes, np.uint64))
            # The first small READ wires up (while the holder makes progress for it): here, not in a job.
            deadline = time.monotonic() + self.timeout_s
            self._finish(t.start_read_prepared(landing, np.zeros(1), remote, np.zeros(1), not_after=deadline),
                         deadline, endpoint)
        except Exception as e:
            for prepared in (remote, landing):
                if prepared is not None:
                    t.unprepare(prepared)
            log.info("tier: %s's chunk table cannot be READ (%s): resolving over RPC", endpoint, e)
            return
        self._tables[endpoint] = _Table(reply.agent_name, reply.base, reply.buckets, reply.ways, info.pool_base,
                                        info.layout.num_blocks, remote, landing)

    def _drop_table(self, endpoint: str) -> None:
        table = self._tables.pop(endpoint, None)
        self._table_asked.discard(endpoint)
        if table is not None:
            self.transfer.unprepare(table.remote)
            self.transfer.unprepare(table.landing)

    def _forget_holder(self, endpoint: str) -> None:
        self._drop_table(endpoint)
        self._last_info.pop(endpoint, None)
        self._agents.pop(endpoint, None)

    def _load_leased(self, run: LoadRun, leases: list[tuple[str, int]], phases: list[float]) -> list[bytes]:
        """Resolve ``run`` at its holder, READ the rows it names, release: the keys read (a prefix). The lease
        taken is released here once READ (its answer validates the bytes); until then it is in ``leases``, which
        the caller releases if this raises."""
        client = self._client(run.endpoint)
        t = self.transfer
        started = time.monotonic()
        reply = client.call(Resolve(run.hashes, self.lease_ttl_ms, self.worker_id,
                                    [name for name in (self._agent_of(run.endpoint),) if name and t.has_peer(name)]),
                            fail_fast=True)
        resolved = time.monotonic()
        phases[0] += resolved - started
        if reply.reason != "ok" or reply.matched == 0:
            return []
        leases.append((run.endpoint, reply.lease_id))
        info = reply.metadata[0]
        if not t.has_peer(info.agent_name):
            if info.agent_metadata is None:
                raise RemoteG2Error(f"{run.endpoint} sent no metadata for agent {info.agent_name}")
            t.add_peer(info.agent_name, info.agent_metadata)
        self._agents[run.endpoint] = info.agent_name
        rows = list(reply.ranks[0].block_ids[:reply.matched])
        if info.layout.block_bytes != self.row_bytes or any(not 0 <= r < info.layout.num_blocks for r in rows):
            raise RemoteG2Error(f"{run.endpoint} answered rows outside its region or of another size "
                                f"({info.layout.block_bytes} bytes, not {self.row_bytes})")
        deadline = started + min(self.timeout_s, reply.expires_in_ms / 2000)
        local, remote, nbytes = coalesce(run.rows[:len(rows)], rows, self.row_bytes, self.region_base,
                                         info.pool_base)
        try:
            self._finish(t.start_read(info.agent_name, local, remote, nbytes, not_after=deadline), deadline,
                         run.endpoint)
        finally:
            phases[1] += time.monotonic() - resolved
        leases.pop()  # (released here: its answer decides whether the bytes stand)
        if not client.call(Release(reply.lease_id), fail_fast=True).released:
            raise RemoteG2Error(f"{run.endpoint}: the chunks changed or the lease lapsed during the READ")
        self._last_info[run.endpoint] = info  # (its region and agent: what a table of its points into)
        table = self._tables.get(run.endpoint)
        if table is not None and table.agent != info.agent_name:  # (restarted: its table is asked for anew)
            self._drop_table(run.endpoint)
        return run.keys[:len(rows)]

    def _agent_of(self, endpoint: str) -> str | None:
        return self._agents.get(endpoint)
