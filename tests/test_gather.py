"""Gathered reads in one process: the source's staging arena and gather thread, the target's staged READs.

The source side is the real :class:`~remote_g2.source.gather.Gatherer` over a
numpy pool and a real :class:`~remote_g2.source.staging.StagingArena`; the
target side is the real :class:`~remote_g2.target.rank_worker.RankWorker`
over the same-process ``memcpy`` adapter (the NIXL path runs in
``test_target_mpi.py`` / ``test_target_failures.py``). What is pinned down:
staged bytes are exactly what the in-place plan would read, a reader never
reads past the staged-blocks counter, the rule leaves few or large
descriptors in place, and no staging range outlives its lease or is handed
out while a gather still writes it.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from source_procs.pattern import make_layout

from remote_g2.adapters.memcpy_transfer import MemcpyTransfer
from remote_g2.protocol.messages import GatherSlot, GatherWish, RankBlocks, RankInfo, TargetDone, TargetLoad
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.source import gather as gather_module
from remote_g2.source.gather import Gatherer
from remote_g2.source.staging import ALIGN, StagingArena
from remote_g2.target.rank_worker import RankWorker, scratch_words
from remote_g2.target.tp_mapping import ReadPlanner

SRC_LAYOUT = make_layout(num_blocks=64, num_kv_heads=2)  # a TP-1 source of 2 kv heads: 1 KiB blocks
SOURCE = "gather-test-src-tp0"


# -- the staging arena ------------------------------------------------------------------------------


def test_ranges_are_page_aligned_first_fit_and_merge_back_when_freed():
    arena = StagingArena(16 * ALIGN)
    a = arena.take(1, 100)
    b = arena.take(2, ALIGN + 1)
    assert (a - arena.base, b - arena.base) == (0, ALIGN)
    assert arena.in_use == 3 * ALIGN
    for lease, addr in ((1, a), (2, b)):
        assert arena.filled(lease, addr)
    assert arena.take(3, 13 * ALIGN) is not None and arena.take(4, 1) is None  # full: the caller reads in place
    assert arena.release(2) == 2 * ALIGN and arena.release(1) == ALIGN
    assert arena.take(5, 3 * ALIGN) == arena.base  # the two freed neighbours merged into one range
    assert arena.held_by(5) == 3 * ALIGN and arena.release(99) == 0


def test_a_range_whose_lease_ends_while_it_is_written_is_freed_only_when_the_writer_is_done():
    arena = StagingArena(4 * ALIGN)
    addr = arena.take(7, 4 * ALIGN)
    assert not arena.ended(7, addr)
    assert arena.release(7) == 0 and arena.in_use == 4 * ALIGN  # busy: not handed to anyone yet
    assert arena.ended(7, addr) and arena.take(8, 1) is None
    assert arena.filled(7, addr) is False  # the writer learns its lease is gone; the range is free now
    assert arena.in_use == 0 and arena.take(8, 4 * ALIGN) == addr


def test_words_are_stored_only_aligned_and_inside_the_region():
    arena = StagingArena(ALIGN)
    arena.store_word(arena.base + 8, 42)
    assert int(arena.buffer.view(np.uint64)[1]) == 42
    for bad in (arena.base + 4, arena.base + ALIGN, arena.base - 8):
        with pytest.raises(ValueError):
            arena.store_word(bad, 1)


# -- the gather and the staged READ -----------------------------------------------------------------


class Rig:
    """A TP-1 source pool (2 kv heads, blocks in a random order), its arena and gatherer, and TP-2 readers."""

    def __init__(self, *, staging_bytes: int = 1 << 20, chunk_bytes: int = 4 * 1024, min_descriptors: int = 1,
                 max_piece_bytes: int = 1 << 20) -> None:
        self.pool = np.random.default_rng(5).integers(0, 256, SRC_LAYOUT.num_blocks * SRC_LAYOUT.block_bytes,
                                                      dtype=np.uint8)
        self.arena = StagingArena(staging_bytes)
        self.gatherer = Gatherer(self.arena, rank=0, source_tp=1, layout=SRC_LAYOUT,
                                 pool_base=self.pool.ctypes.data, min_descriptors=min_descriptors,
                                 max_piece_bytes=max_piece_bytes, chunk_bytes=chunk_bytes,
                                 observe=lambda o, n, s: self.outcomes.append(o))
        self.outcomes: list[str] = []
        MemcpyTransfer.expose(SOURCE, [MemoryRegion(self.pool.ctypes.data, self.pool.nbytes),
                                       MemoryRegion(self.arena.base, self.arena.nbytes)])
        self.info = RankInfo(0, SOURCE, b"memcpy", self.pool.ctypes.data, self.pool.nbytes, SRC_LAYOUT,
                             staging_base=self.arena.base, staging_bytes=self.arena.nbytes)
        self.readers = [Reader(r) for r in range(2)]

    def close(self) -> None:
        for r in self.readers:
            r.worker.close()
        self.gatherer.close()
        MemcpyTransfer.unexpose(SOURCE)

    def expected(self, rank: int, ids: list[int]) -> np.ndarray:
        """What target rank ``rank`` (1 head of 2) holds for the source's blocks ``ids``, block after block."""
        out = []
        for b in ids:
            for off, n in SRC_LAYOUT.head_extents(b, rank, rank + 1):
                out.append(self.pool[off:off + n])
        return np.concatenate(out)


class Reader:
    """One target rank of a TP-2 reader: destination blocks, scratch words, a RankWorker."""

    LAYOUT = make_layout(num_blocks=64, num_kv_heads=1)

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.dst = np.zeros(self.LAYOUT.num_blocks * self.LAYOUT.block_bytes, dtype=np.uint8)
        self.scratch = scratch_words()
        transfer = MemcpyTransfer(f"gather-test-dst-tp{rank}")
        transfer.register_local([MemoryRegion(self.dst.ctypes.data, self.dst.nbytes),
                                 MemoryRegion(self.scratch.ctypes.data, self.scratch.nbytes)])
        self.reports: list[TargetDone] = []
        self.worker = RankWorker(rank=rank, tp_size=2, layout=self.LAYOUT, pool_base=self.dst.ctypes.data,
                                 transfer=transfer, report=self.reports.append, scratch=self.scratch)

    def start(self, load_id: int, info: RankInfo, ids: list[int], staged: list[GatherSlot], *,
              timeout_ms: int = 5000) -> None:
        load = TargetLoad(load_id, "src", 1, 1, False, 0, [RankBlocks(0, ids, staged)], [info],
                          list(range(len(ids))), timeout_ms, time.monotonic_ns() + timeout_ms * 1_000_000)
        self.worker.start(load, time.monotonic())

    def wait(self, timeout_s: float = 5.0) -> TargetDone:
        deadline = time.monotonic() + timeout_s
        while not self.reports and time.monotonic() < deadline:
            self.worker.poll()
            time.sleep(0.0005)
        assert self.reports, "the load was never reported"
        return self.reports.pop()

    def landed(self, nblocks: int) -> np.ndarray:
        return self.dst[:nblocks * self.LAYOUT.block_bytes]


@pytest.fixture()
def rig():
    r = Rig()
    yield r
    r.close()


def _wait_counter(slot: GatherSlot, arena: StagingArena, value: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while int(arena.buffer.view(np.uint64)[(slot.ready_addr - arena.base) // 8]) != value:
        assert time.monotonic() < deadline, "the gather never got there"
        time.sleep(0.001)


def test_a_split_head_lease_is_staged_per_target_rank_and_read_byte_for_byte(rig):
    ids = np.random.default_rng(1).permutation(64)[:20].tolist()
    slots = rig.gatherer.stage(11, ids, GatherWish(target_tp=2, target_heads=1))
    assert [s.target_rank for s in slots] == [0, 1] and slots[0].addr != slots[1].addr
    assert all(s.blocks == 20 and s.block_stride == SRC_LAYOUT.block_bytes // 2 for s in slots)
    for reader in rig.readers:
        reader.start(1, rig.info, ids, slots)
    for reader in rig.readers:
        done = reader.wait()
        assert done.ok, done.error
        # 20 blocks in 4 KiB chunks of 512-byte blocks: 3 chunks, each read as one descriptor
        assert done.descriptors == 3
        assert np.array_equal(reader.landed(20), rig.expected(reader.rank, ids))
    assert rig.outcomes == ["staged", "staged"]
    rig.arena.release(11)
    assert rig.arena.in_use == 0


def test_a_peer_share_stages_only_the_asking_target_ranks_part(rig):
    """A ``peer_resolve``'s wish names its target rank: only that rank's part is staged (its sibling asks for
    its own under its own lease); a rank the reader does not have is no part at all."""
    ids = np.random.default_rng(3).permutation(64)[:12].tolist()
    (slot,) = rig.gatherer.stage(13, ids, GatherWish(target_tp=2, target_heads=1, target_rank=1))
    assert slot.target_rank == 1
    reader = rig.readers[1]
    reader.start(1, rig.info, ids, [slot])
    done = reader.wait()
    assert done.ok, done.error
    assert np.array_equal(reader.landed(12), rig.expected(1, ids))
    assert rig.gatherer.stage(14, ids, GatherWish(target_tp=2, target_heads=1, target_rank=2)) == []
    assert rig.outcomes == ["staged", "unservable"]
    for lease in (13, 14):
        rig.arena.release(lease)
    assert rig.arena.in_use == 0


def test_the_planner_reads_a_staged_part_chunk_by_chunk_and_refuses_a_slot_it_cannot_trust(rig):
    ids = list(range(40, 30, -1))
    slot = rig.gatherer.stage(12, ids, GatherWish(2, 1))[1]
    planner = ReadPlanner(source_tp=1, source_ranks=[rig.info], target_layout=Reader.LAYOUT, target_base=0,
                          target_tp=2, target_rank=1)
    plan = planner.plan([RankBlocks(0, ids, [slot])], list(range(10)))
    (reads,) = plan.reads
    assert reads.ready_addr == slot.ready_addr and reads.need is not None
    assert reads.need.tolist() == [8, 10] and reads.nbytes.tolist() == [8 * 512, 2 * 512]  # chunks of 8 blocks
    assert reads.remote_addr.tolist() == [slot.addr, slot.addr + 8 * 512]
    for bad, why in ((GatherSlot(1, slot.addr, 256, 10, slot.ready_addr, 8), "apart"),
                     (GatherSlot(1, slot.addr, 512, 9, slot.ready_addr, 8), "staged 9 blocks"),
                     (GatherSlot(1, rig.arena.base + rig.arena.nbytes, 512, 10, slot.ready_addr, 8), "outside"),
                     (GatherSlot(1, slot.addr, 512, 10, slot.ready_addr + 4, 8), "outside")):
        with pytest.raises(ValueError, match=why):
            planner.plan([RankBlocks(0, ids, [bad])], list(range(10)))
    _wait_counter(slot, rig.arena, 10)


def test_the_rule_leaves_few_or_large_descriptors_in_place_and_a_full_region_reads_in_place():
    rig = Rig(min_descriptors=16, max_piece_bytes=256)
    try:
        consecutive = list(range(8, 28))  # same TP: one descriptor whatever the count
        assert rig.gatherer.stage(1, consecutive, GatherWish(1, 2)) == []
        scattered = np.random.default_rng(2).permutation(64)[:20].tolist()
        assert rig.gatherer.stage(2, scattered, GatherWish(1, 2)) == []  # 20 pieces of 1 KiB > 256 B
        assert len(rig.gatherer.stage(3, scattered, GatherWish(2, 1))) == 2  # 160 head slices of 256 B
        assert rig.gatherer.stage(4, scattered, GatherWish(3, 1)) == []  # 3 heads in all: not this model
        assert rig.outcomes[:2] == ["direct", "direct"] and rig.outcomes[-1] == "unservable"
    finally:
        rig.close()
    small = Rig(staging_bytes=ALIGN, min_descriptors=1)
    try:
        ids = list(range(0, 64, 2))  # 32 blocks: 16 KiB per target rank, more than the whole region
        assert small.gatherer.stage(5, ids, GatherWish(2, 1)) == []
        assert small.outcomes == ["no_room", "no_room"] and small.arena.in_use == 0
    finally:
        small.close()


def test_a_reader_never_reads_past_the_counter_and_fails_at_its_deadline_when_it_stops(rig):
    """The source's side played by hand: a reader posts exactly the chunks the count covers, and no more."""
    ids = np.random.default_rng(4).permutation(64)[:24].tolist()
    block = Reader.LAYOUT.block_bytes  # 512 bytes of target rank 0's heads per source block
    addr = rig.arena.take(21, 24 * block + 8)
    ready = addr + 24 * block
    rig.arena.store_word(ready, 0)
    staged = np.frombuffer(rig.arena.buffer, dtype=np.uint8)[addr - rig.arena.base:ready - rig.arena.base]
    want = rig.expected(0, ids)
    slot = GatherSlot(0, addr, block, 24, ready, 8)
    reader = rig.readers[0]
    reader.start(1, rig.info, ids, [slot], timeout_ms=400)
    for count in (8, 16):  # stage a chunk, count it, let the reader catch up
        staged[(count - 8) * block:count * block] = want[(count - 8) * block:count * block]
        rig.arena.store_word(ready, count)
        for _ in range(3):
            time.sleep(0.002)
            reader.worker.poll()
        assert np.array_equal(reader.landed(24)[:count * block], want[:count * block])
        assert not reader.landed(24)[count * block:].any()
    staged[16 * block:] = want[16 * block:]  # staged, never counted: the reader must not take it
    done = reader.wait()
    assert not done.ok and "staged 16 of 24 blocks" in done.error, done.error
    assert not reader.landed(24)[16 * block:].any()
    assert rig.arena.filled(21, addr) and rig.arena.release(21) > 0


def test_a_counter_read_refused_for_its_deadline_reports_the_deadline_with_what_was_staged(rig, monkeypatch):
    """The deadline can pass between the reader's own check and the adapter's (``not_after``): that is the
    deadline, reported with what was staged, not a READ error. Stand-in: the adapter's start is held past
    ``not_after``, as a thread preempted between the two checks is, for the counter READs after the first chunk."""
    ids = np.random.default_rng(5).permutation(64)[:24].tolist()
    block = Reader.LAYOUT.block_bytes
    addr = rig.arena.take(22, 24 * block + 8)
    ready = addr + 24 * block
    rig.arena.store_word(ready, 0)
    staged = np.frombuffer(rig.arena.buffer, dtype=np.uint8)[addr - rig.arena.base:ready - rig.arena.base]
    want = rig.expected(0, ids)
    reader = rig.readers[0]
    transfer = reader.worker._transfer
    real, late = transfer.start_read, []

    def start_read(agent, local, remote, nbytes, *, not_after=None):
        if late and len(nbytes) == 1 and int(nbytes[0]) == 8 and not_after is not None:  # a counter READ
            time.sleep(max(0.0, not_after - time.monotonic()) + 0.002)
        return real(agent, local, remote, nbytes, not_after=not_after)

    monkeypatch.setattr(transfer, "start_read", start_read)
    reader.start(1, rig.info, ids, [GatherSlot(0, addr, block, 24, ready, 8)], timeout_ms=300)
    staged[:8 * block] = want[:8 * block]
    rig.arena.store_word(ready, 8)
    for _ in range(3):
        time.sleep(0.002)
        reader.worker.poll()
    assert np.array_equal(reader.landed(24)[:8 * block], want[:8 * block])
    late.append(True)
    done = reader.wait()
    assert not done.ok and "staged 8 of 24 blocks" in done.error, done.error
    assert not reader.landed(24)[8 * block:].any()
    assert rig.arena.filled(22, addr) and rig.arena.release(22) > 0


def test_a_lease_that_ends_before_its_part_is_packed_stops_the_gather_and_frees_its_range(monkeypatch):
    gate = threading.Event()
    pack = gather_module.pack_chunks

    def held(*args, **kwargs):  # the gather thread is held before it starts packing
        gate.wait(10)
        return pack(*args, **kwargs)

    monkeypatch.setattr(gather_module, "pack_chunks", held)
    rig = Rig()
    try:
        ids = np.random.default_rng(4).permutation(64)[:24].tolist()
        slots = rig.gatherer.stage(22, ids, GatherWish(2, 1))
        assert len(slots) == 2 and rig.arena.in_use > 0
        assert rig.arena.release(22) == 0  # both ranges are busy: freed when their writer stops
        gate.set()
        deadline = time.monotonic() + 5
        while rig.arena.in_use and time.monotonic() < deadline:
            time.sleep(0.001)
        assert rig.arena.in_use == 0 and rig.outcomes == ["lease_gone", "lease_gone"]
        words = rig.arena.buffer.view(np.uint64)
        assert [int(words[(s.ready_addr - rig.arena.base) // 8]) for s in slots] == [0, 0]  # nothing counted
    finally:
        gate.set()
        rig.close()
