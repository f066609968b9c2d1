"""One target rank's data path: plan this rank's share of a load, issue its READs, watch them.

A :class:`RankWorker` is a state machine driven by one thread — the thread
that owns the rank's transfer adapter (NIXL agents are not thread-safe in
their default mode): the leader's share thread on rank 0, the serving loop
that reads the leader's link on every other rank. Nothing is handed to
another thread on the way from "this rank got its share" to "the READ is
posted".

Per load (:meth:`RankWorker.start`): plan with a
:class:`~remote_g2.target.tp_mapping.ReadPlanner` (this rank's layout and pool
address; kept per source epoch, so the layout checks run once per source,
not once per load), load any source agent not yet known for that source epoch
(metadata is cached per agent name; a new epoch drops the old agents first),
start one READ per source rank, and check them once right away (on one
host the bytes land inside the post, so the load is reported before the
loop starts anything else). :meth:`RankWorker.poll` checks every in-flight
READ without blocking. A load past its deadline has its READs
released (NIXL aborts what still runs) and is reported failed. Nothing is
reported ``ok`` unless every READ of the load said ``done``; every load is
reported exactly once, through ``report(TargetDone)``.

The handles of a load that succeeded are freed after the report, when the
driving loop calls :meth:`RankWorker.release_retired` — not inside the
report's call chain: freeing them costs tens of microseconds, and on the
leader the coordinator that waits for the report shares the CPU with the
share thread. A failed load's READs are released (aborted) *before* it is
reported, so no byte moves once the engine hears of the failure.

A part its source rank stages while this rank reads it (a
:class:`~remote_g2.protocol.messages.GatherSlot`, ``source/gather.py``) is read as
it is staged: the worker READs the part's staged-blocks counter into a
word of its scratch region, posts a READ of every descriptor the count
covers, and reads the counter again until every descriptor is posted (one
step per check, so a slow gather costs polls, not a spinning thread). A
counter that stops short — the lease ended, the source died — leaves the
load to its deadline: it fails, and nothing past the count was read. The
scratch word of a failed load sits out ``SCRATCH_QUARANTINE_S`` before
another load uses it: an aborted counter READ may still land.

A part whose destination pieces are small and scattered while its source
rows are adjacent is read into the rank's bounce region instead and
scattered here once its READ (or, for a staged part, each posted batch's
READ) is done (:mod:`.bounce`: the rule, and why). The scatter writes the
destination, so it too happens only before the deadline.

The deadline is the leader's (``TargetLoad.deadline_ns``) when this rank
shares the leader's monotonic clock, else ``timeout_ms`` from the message's
arrival. No READ is posted after it — the adapter checks it right before
bytes move — because by then the leader may have reported the request failed
and the engine may be recomputing into the same destination blocks.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from remote_g2.errors import TransferError
from remote_g2.transfer import TransferAdapter

from remote_g2.protocol.messages import BlockLayout, RankInfo, TargetDone, TargetLoad
from remote_g2.memory.secondary_pool import MemoryRegion

from .config import TargetConfig
from .bounce import Bounce, BounceRegion
from .read_plan import SourceReads
from .tp_mapping import ReadPlanner

__all__ = ["RankWorker", "POLL_S", "SCRATCH_WORDS", "SCRATCH_QUARANTINE_S", "scratch_words", "rank_buffers"]

log = logging.getLogger("remote_g2.target")

POLL_S = 0.0002  # how long a driving loop sleeps between polls while READs are in flight
SCRATCH_WORDS = 4096  # staged parts in flight at most per rank (a word each, 64 bytes apart: own cache lines)
SCRATCH_QUARANTINE_S = 30.0


def scratch_words() -> np.ndarray:
    """A fresh scratch region for :class:`RankWorker` (register it with the rank's transfer adapter)."""
    return np.zeros(SCRATCH_WORDS * 8, dtype=np.uint64)


def rank_buffers(regions: Sequence[MemoryRegion], config: TargetConfig
                 ) -> tuple[list[MemoryRegion], np.ndarray | None, BounceRegion | None]:
    """The regions to register for a rank — its pool's, a scratch region when it may read staged parts, a
    bounce region (``config.bounce_mib``) — and the scratch words and bounce region themselves.

    Only with a pool in host memory (one READ uses one memory kind, so a pool
    in device memory reads every piece in place); scratch only with ``config.gather``.
    """
    if any(r.mem_type != "DRAM" for r in regions):
        return list(regions), None, None
    out = list(regions)
    scratch = scratch_words() if config.gather else None
    if scratch is not None:
        out.append(MemoryRegion(scratch.ctypes.data, scratch.nbytes))
    bounce = BounceRegion(config.bounce_mib << 20) if config.bounce_mib else None
    if bounce is not None:
        out.append(bounce.region)
    return out, scratch, bounce


@dataclass
class _Staged:
    """A staged part read as it is staged: the descriptors posted so far, the counter READ in flight."""

    reads: SourceReads
    word: int
    bounce: Bounce | None = None
    posted: int = 0
    counter: Any = None
    counts_read: int = 0  # counter READs completed (a stall's report tells a silent source from a slow one)

    @property
    def complete(self) -> bool:
        """Every descriptor posted (no counter READ left to make)."""
        return self.posted == self.reads.num_descriptors


@dataclass
class _Inflight:
    load: TargetLoad
    deadline: float
    handles: list[Any] = field(default_factory=list)
    nbytes: int = 0
    descriptors: int = 0
    staged: list[_Staged] = field(default_factory=list)
    bounces: list[Bounce] = field(default_factory=list)
    #: READs whose bytes still wait in a bounce range: (handle, bounce, first read row, end read row)
    scatters: list[tuple[Any, Bounce, int, int]] = field(default_factory=list)


class RankWorker:
    """Execute this rank's READs for every load it is given; report each load's outcome once."""

    def __init__(self, *, rank: int, tp_size: int, layout: BlockLayout, pool_base: int,
                 transfer: TransferAdapter, report: Callable[[TargetDone], None],
                 shares_leader_clock: bool = True, scratch: np.ndarray | None = None,
                 bounce: BounceRegion | None = None, stats: dict[str, int] | None = None) -> None:
        """``scratch``: ``uint64`` words registered with ``transfer`` (:func:`scratch_words`), where staged
        parts' counters land; None: a load with a staged part fails (and is recomputed). ``bounce``:
        a region registered with ``transfer`` (:mod:`.bounce`); None: every piece lands where it belongs.
        ``stats``: where this rank counts ``bounced_reads`` (READs of loads that succeeded that went
        through the bounce region) and ``bounced_bytes`` (bytes scattered from it)."""
        self.rank = rank
        self.shares_leader_clock = shares_leader_clock
        self.tp_size = tp_size
        self.layout = layout
        self.pool_base = pool_base
        self._transfer = transfer
        self._report = report
        self._inflight: dict[int, _Inflight] = {}
        # source worker -> (epoch, {source rank: RankInfo}); agents loaded into the adapter
        self._sources: dict[str, tuple[int, dict[int, RankInfo]]] = {}
        self._loaded: set[str] = set()
        # (source worker, is_mla, mla_offset) -> planner for the worker's current epoch and rank infos
        self._planners: dict[tuple[str, bool, int], ReadPlanner] = {}
        self._retired: list[Any] = []  # handles of reported, successful loads: every READ is done
        self._scratch = scratch
        self._bounce = bounce
        self.stats = stats if stats is not None else {}
        self.stats.update(bounced_reads=0, bounced_bytes=0)
        stride = 8  # words 64 bytes apart
        self._free_words: list[int] = list(range(0, 0 if scratch is None else scratch.shape[0], stride))[::-1]
        self._quarantined: deque[tuple[float, list[int]]] = deque()
        self._closed = False

    @property
    def busy(self) -> bool:
        """Whether READs are in flight (the driving loop should :meth:`poll` soon)."""
        return bool(self._inflight)

    @property
    def retired(self) -> bool:
        """Whether finished READs' handles wait for :meth:`release_retired`."""
        return bool(self._retired)

    def release_retired(self) -> None:
        """Free the handles of loads already reported done (their READs all finished)."""
        handles, self._retired = self._retired, []
        for h in handles:
            self._transfer.release(h)

    def source_info(self, worker: str, epoch: int, rank: int) -> RankInfo | None:
        """What this rank holds of source ``worker``'s rank ``rank`` for ``epoch`` (None: nothing for that epoch)."""
        known = self._sources.get(worker)
        if known is None or known[0] != epoch:
            return None
        return known[1].get(rank)

    def start(self, load: TargetLoad, received: float) -> None:
        """Plan and post this rank's READs of ``load`` (``received``: when it reached this rank, monotonic)."""
        if self._closed:
            self._report_now(load, 0, 0, "the target client shut down")
            return
        flight = _Inflight(load, self._deadline(load, received))
        self._inflight[load.load_id] = flight
        if time.monotonic() > flight.deadline:
            self._finish(load.load_id, "the load's deadline passed before this rank could start it")
            return
        try:
            infos = self._source_ranks(load)
            plan = self._planner(load, infos).plan(load.ranks, load.dst_block_ids)
            for reads in plan.reads:
                info = infos[reads.source_rank]
                if info.agent_name not in self._loaded:
                    if info.agent_metadata is None:
                        raise RuntimeError(f"no metadata for source agent {info.agent_name}")
                    self._transfer.add_peer(info.agent_name, info.agent_metadata)
                    self._loaded.add(info.agent_name)
                bounce = self._bounce.land(reads) if self._bounce is not None else None
                if bounce is not None:
                    flight.bounces.append(bounce)
                    reads = bounce.reads
                if reads.ready_addr:
                    staged = _Staged(reads, self._take_word(), bounce)
                    flight.staged.append(staged)
                    self._read_counter(flight, staged)
                    continue
                self._post(flight, reads, 0, reads.num_descriptors, bounce)
        except Exception as e:
            self._finish(load.load_id, f"{type(e).__name__}: {e}")
            return
        # On one host the bytes usually landed inside the post: report now, not after whatever
        # this rank's loop starts next (another load's copy would hold the report back that long).
        self._check(load.load_id, flight, time.monotonic())

    def poll(self) -> None:
        """Check every in-flight READ without blocking; report the loads that ended."""
        now = time.monotonic()
        for key, flight in list(self._inflight.items()):
            self._check(key, flight, now)

    def close(self) -> None:
        """Fail every load still in flight (their READs released), then close the adapter. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for key in list(self._inflight):
            self._finish(key, "the target client shut down")
        self.release_retired()
        self._transfer.close()

    # -- internals -------------------------------------------------------------------------

    def _check(self, key: int, flight: _Inflight, now: float) -> None:
        try:
            for staged in flight.staged:
                self._advance(flight, staged)
        except Exception as e:
            self._finish(key, f"{type(e).__name__}: {e}")
            return
        handles = flight.handles + [s.counter for s in flight.staged if s.counter is not None]
        states = [self._transfer.poll(h) for h in handles]
        if "error" in states:
            # The adapter's own words when it has them (an optional method: see remote_g2/transfer.py).
            failure = getattr(self._transfer, "failure", None)
            why = [failure(h) for h, s in zip(handles, states) if s == "error"] if failure else []
            self._finish(key, next((w for w in why if w), "READ failed (transfer state ERR)"))
            return
        if flight.scatters and not self._scatter(flight, {id(h) for h, s in zip(handles, states) if s == "done"}):
            self._finish(key, f"the load's deadline passed before its bounced bytes were scattered "
                         f"({flight.load.timeout_ms} ms)")
        elif all(s == "done" for s in states) and all(s.complete for s in flight.staged):
            self._finish(key, None)
        elif now > flight.deadline:
            short = [f"source rank {s.reads.source_rank} staged {self._count(s) if s.counts_read else 0} of "
                     f"{int(s.reads.need[-1])} blocks (counter read back {s.counts_read} times)"
                     for s in flight.staged if not s.complete]
            self._finish(key, f"READ not finished within {flight.load.timeout_ms} ms"
                         + (f" ({'; '.join(short)}: its lease ended or the source stopped)" if short else ""))

    def _post(self, flight: _Inflight, reads: SourceReads, lo: int, hi: int, bounce: Bounce | None) -> None:
        """Post one READ of rows ``[lo, hi)`` of ``reads``; a bounced one is scattered once it is done."""
        handle = self._transfer.start_read(reads.agent_name, reads.local_addr[lo:hi], reads.remote_addr[lo:hi],
                                           reads.nbytes[lo:hi], not_after=flight.deadline)
        flight.handles.append(handle)
        if bounce is not None:
            flight.scatters.append((handle, bounce, lo, hi))
        flight.nbytes += int(reads.nbytes[lo:hi].sum(dtype=np.uint64))
        flight.descriptors += hi - lo

    def _scatter(self, flight: _Inflight, done: set[int]) -> bool:
        """Scatter every bounced READ in ``done`` (handle ids); False: the deadline passed first (nothing written)."""
        waiting = []
        for item in flight.scatters:
            if id(item[0]) not in done:
                waiting.append(item)
                continue
            if time.monotonic() > flight.deadline:
                return False
            _, bounce, lo, hi = item
            self.stats["bounced_bytes"] += bounce.scatter(lo, hi)
        flight.scatters = waiting
        return True

    # -- staged parts (source/gather.py) ---------------------------------------------------

    def _take_word(self) -> int:
        now = time.monotonic()
        while self._quarantined and self._quarantined[0][0] <= now:
            self._free_words.extend(self._quarantined.popleft()[1])
        if self._scratch is None:
            raise RuntimeError("a staged part, and no scratch region to read its counter into")
        if not self._free_words:
            raise RuntimeError(f"all {self._scratch.shape[0] // 8} scratch words in use")
        return self._free_words.pop()

    def _count(self, staged: _Staged) -> int:
        assert self._scratch is not None
        return int(self._scratch[staged.word])

    def _read_counter(self, flight: _Inflight, staged: _Staged) -> None:
        """Post a READ of the part's staged-blocks counter into its scratch word."""
        assert self._scratch is not None
        u = np.uint64
        local = np.array([self._scratch.ctypes.data + 8 * staged.word], dtype=u)
        staged.counter = self._transfer.start_read(staged.reads.agent_name, local,
                                                   np.array([staged.reads.ready_addr], dtype=u),
                                                   np.array([8], dtype=u), not_after=flight.deadline)

    def _advance(self, flight: _Inflight, staged: _Staged) -> None:
        """One step of a staged part: when its counter READ is done, post what the count covers; read it again."""
        if staged.counter is None or self._transfer.poll(staged.counter) != "done":
            return
        self._transfer.release(staged.counter)
        staged.counter = None
        staged.counts_read += 1
        reads = staged.reads
        assert reads.need is not None
        ready = int(np.searchsorted(reads.need, np.uint64(self._count(staged)), side="right"))
        if ready > staged.posted:
            self._post(flight, reads, staged.posted, ready, staged.bounce)
            staged.posted = ready
        if not staged.complete and time.monotonic() <= flight.deadline:  # past it, the check reports the load
            try:
                self._read_counter(flight, staged)
            except TransferError:
                # The deadline can pass between the test above and the adapter's own (not_after): then
                # this is the deadline, which the check reports with what was staged, not a READ error.
                if time.monotonic() <= flight.deadline:
                    raise

    def _deadline(self, load: TargetLoad, received: float) -> float:
        if self.shares_leader_clock and load.deadline_ns:
            return load.deadline_ns / 1e9
        return received + load.timeout_ms / 1000.0

    def _planner(self, load: TargetLoad, infos: list[RankInfo]) -> ReadPlanner:
        key = (load.source_worker, load.is_mla, load.mla_offset)
        planner = self._planners.get(key)
        if planner is None or planner.source_tp != load.source_tp:
            planner = ReadPlanner(source_tp=load.source_tp, source_ranks=infos, target_layout=self.layout,
                                  target_base=self.pool_base, target_tp=self.tp_size, target_rank=self.rank,
                                  is_mla=load.is_mla, mla_offset=load.mla_offset)
            self._planners[key] = planner
        return planner

    def _source_ranks(self, load: TargetLoad) -> list[RankInfo]:
        """Every source rank's info, by rank, with agent metadata remembered across loads of one epoch."""
        known = self._sources.get(load.source_worker)
        restarted = known is not None and known[0] != load.source_epoch
        if known is None or restarted:
            if known is not None:  # the source restarted: its old agents, and plans against its old pools, are gone
                for info in known[1].values():
                    if info.agent_name in self._loaded:
                        self._transfer.remove_peer(info.agent_name)
                        self._loaded.discard(info.agent_name)
            known = (load.source_epoch, {})
            self._sources[load.source_worker] = known
        ranks = known[1]
        if restarted or load.metadata:  # a restarted source, or new rank infos: plan (and check) against them
            self._drop_planners(load.source_worker)
        for info in load.metadata:
            if info.agent_metadata is not None or info.rank not in ranks:
                ranks[info.rank] = info
        missing = [r for r in range(load.source_tp) if r not in ranks]
        if missing:
            raise RuntimeError(f"source {load.source_worker}: no rank info for source rank(s) {missing}")
        return [ranks[r] for r in range(load.source_tp)]

    def _drop_planners(self, worker: str) -> None:
        for key in [k for k in self._planners if k[0] == worker]:
            del self._planners[key]

    def _finish(self, key: int, error: str | None) -> None:
        flight = self._inflight.pop(key)
        words = [s.word for s in flight.staged]
        if words and error is None:
            self._free_words.extend(words)
        elif words:  # a counter READ of a failed load may still land: keep its word out for a while
            self._quarantined.append((time.monotonic() + SCRATCH_QUARANTINE_S, words))
        for bounce in flight.bounces:
            assert self._bounce is not None
            self._bounce.give_back(bounce, failed=error is not None)
            self.stats["bounced_reads"] += error is None
        if error is None:
            # Every READ said done: no byte moves any more, so the leader hears first (it waits for the
            # slowest rank) and the handles are freed later (release_retired).
            self._report_now(flight.load, flight.nbytes, flight.descriptors, None)
            self._retired.extend(flight.handles)
            return
        for h in flight.handles + [s.counter for s in flight.staged if s.counter is not None]:
            self._transfer.release(h)  # a READ still running is aborted here, before the failure is reported
        log.warning("target rank %d: load %d from %s failed: %s", self.rank, key, flight.load.source_worker, error)
        self._report_now(flight.load, flight.nbytes, flight.descriptors, error)

    def _report_now(self, load: TargetLoad, nbytes: int, descriptors: int, error: str | None) -> None:
        try:
            self._report(TargetDone(load.load_id, self.rank, error is None, (error or "")[:4000], nbytes,
                                    descriptors, len(load.dst_block_ids) if error is None else 0))
        except Exception as e:  # the leader times the load out on its own
            log.warning("target rank %d: could not report load %d: %s", self.rank, load.load_id, e)
