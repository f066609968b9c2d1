"""The target's bounce region in one process: small scattered destination pieces READ in one run, scattered here.

A TP-2 source (one kv head per rank, its blocks in a random order) read by a
TP-1 target (both heads): each source block is adjacent on the source but
lands as one 128-byte piece per (layer, K/V) slab of a target block — the
TP 2 → 1 case with a head per source rank. The real
:class:`~remote_g2.target.rank_worker.RankWorker` over the same-process
``memcpy`` adapter reads it with a :class:`~remote_g2.target.bounce.BounceRegion`
and, as the reference, without one; the staged variant goes through the real
:class:`~remote_g2.source.gather.Gatherer`. The NIXL path runs in
``test_target_mpi.py``.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from source_procs.pattern import make_layout

from remote_g2.adapters.memcpy_transfer import MemcpyTransfer
from remote_g2.protocol.messages import GatherSlot, GatherWish, RankBlocks, RankInfo, TargetDone, TargetLoad
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.source.gather import Gatherer
from remote_g2.source.staging import StagingArena
from remote_g2.target import bounce as bounce_module
from remote_g2.target.bounce import BOUNCE_MAX_PIECE, BounceRegion, bounce_plan
from remote_g2.target.rank_worker import RankWorker, scratch_words
from remote_g2.target.read_plan import SourceReads, frozen

SRC_LAYOUT = make_layout(num_blocks=64, num_kv_heads=1)  # 512-byte blocks: 4 slabs of 128 bytes
DST_LAYOUT = make_layout(num_blocks=64, num_kv_heads=2)
SLABS = SRC_LAYOUT.num_layers * SRC_LAYOUT.kv


class Source:
    """Two source ranks: a pool each, blocks of random bytes, a staging arena and a gatherer each."""

    def __init__(self) -> None:
        self.pools = [np.random.default_rng([9, r]).integers(0, 256, SRC_LAYOUT.num_blocks * SRC_LAYOUT.block_bytes,
                                                             dtype=np.uint8) for r in range(2)]
        self.arenas = [StagingArena(1 << 20) for _ in range(2)]
        self.gatherers = [Gatherer(self.arenas[r], rank=r, source_tp=2, layout=SRC_LAYOUT,
                                   pool_base=self.pools[r].ctypes.data, min_descriptors=1, max_piece_bytes=1 << 20,
                                   chunk_bytes=4096) for r in range(2)]
        self.infos = []
        for r in range(2):
            name = f"bounce-test-src-tp{r}"
            MemcpyTransfer.expose(name, [MemoryRegion(self.pools[r].ctypes.data, self.pools[r].nbytes),
                                         MemoryRegion(self.arenas[r].base, self.arenas[r].nbytes)])
            self.infos.append(RankInfo(r, name, b"memcpy", self.pools[r].ctypes.data, self.pools[r].nbytes,
                                       SRC_LAYOUT, staging_base=self.arenas[r].base,
                                       staging_bytes=self.arenas[r].nbytes))

    def close(self) -> None:
        for r, g in enumerate(self.gatherers):
            g.close()
            MemcpyTransfer.unexpose(f"bounce-test-src-tp{r}")


class Reader:
    """A TP-1 target rank with both heads: destination blocks, scratch words, a RankWorker, maybe a bounce region."""

    def __init__(self, name: str, bounce: BounceRegion | None) -> None:
        self.dst = np.zeros(DST_LAYOUT.num_blocks * DST_LAYOUT.block_bytes, dtype=np.uint8)
        self.scratch = scratch_words()
        self.bounce = bounce
        transfer = MemcpyTransfer(name)
        regions = [MemoryRegion(self.dst.ctypes.data, self.dst.nbytes),
                   MemoryRegion(self.scratch.ctypes.data, self.scratch.nbytes)]
        transfer.register_local(regions + ([bounce.region] if bounce is not None else []))
        self.reports: list[TargetDone] = []
        self.worker = RankWorker(rank=0, tp_size=1, layout=DST_LAYOUT, pool_base=self.dst.ctypes.data,
                                 transfer=transfer, report=self.reports.append, scratch=self.scratch, bounce=bounce)

    def load(self, source: Source, ranks: list[RankBlocks], dst_ids: list[int], *, timeout_ms: int = 5000,
             load_id: int = 1) -> TargetDone:
        load = TargetLoad(load_id, "src", 1, 2, False, 0, ranks, source.infos, dst_ids, timeout_ms,
                          time.monotonic_ns() + timeout_ms * 1_000_000)
        self.worker.start(load, time.monotonic())
        deadline = time.monotonic() + timeout_ms / 1000 + 2
        while not self.reports and time.monotonic() < deadline:
            self.worker.poll()
            time.sleep(0.0005)
        assert self.reports, "the load was never reported"
        return self.reports.pop()


@pytest.fixture()
def source():
    s = Source()
    yield s
    s.close()


@pytest.fixture()
def readers():
    made = [Reader("bounce-test-dst", BounceRegion(1 << 20)), Reader("bounce-test-ref", None)]
    yield made
    for r in made:
        r.worker.close()


def _picks(seed: int, count: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    src = [rng.permutation(64)[:count].tolist() for _ in range(2)]  # where each source rank holds hash i
    return src, rng.permutation(64)[:count].tolist()


def test_small_pieces_read_in_place_land_in_one_run_per_block_and_scatter_byte_for_byte(source, readers):
    src, dst = _picks(1, 20)
    bounced, ref = readers
    ranks = [RankBlocks(r, src[r]) for r in range(2)]
    got, want = bounced.load(source, ranks, dst), ref.load(source, ranks, dst)
    assert got.ok and want.ok, (got.error, want.error)
    # a READ descriptor per run of adjacent source blocks (bytes adjacent on both sides now)
    runs = sum(1 + int(np.count_nonzero(np.diff(np.sort(ids)) != 1)) for ids in src)
    assert want.descriptors == 2 * 20 * SLABS and got.descriptors == runs < 2 * 20
    assert np.array_equal(bounced.dst, ref.dst) and ref.dst.any()
    assert bounced.worker.stats == {"bounced_reads": 2, "bounced_bytes": 2 * 20 * SRC_LAYOUT.block_bytes}
    assert bounced.bounce.in_use == 0  # a load that succeeded gives its ranges back at once


def test_a_staged_part_bounces_chunk_by_chunk_and_scatters_byte_for_byte(source, readers):
    src, dst = _picks(2, 24)
    lease = 31
    ranks = []
    for r in range(2):
        (slot,) = source.gatherers[r].stage(lease, src[r], GatherWish(target_tp=1, target_heads=2))
        ranks.append(RankBlocks(r, src[r], [slot]))
    bounced, ref = readers
    got, want = bounced.load(source, ranks, dst), ref.load(source, ranks, dst)
    assert got.ok and want.ok, (got.error, want.error)
    # 24 blocks of 512 staged bytes in 4 KiB chunks: 3 chunks per source rank, one READ descriptor each
    assert got.descriptors == 2 * 3 and want.descriptors == 2 * 24 * SLABS
    assert np.array_equal(bounced.dst, ref.dst) and ref.dst.any()
    assert bounced.bounce.in_use == 0
    for arena in source.arenas:
        arena.release(lease)
        assert arena.in_use == 0


def test_a_failed_load_scatters_nothing_past_the_count_and_its_range_sits_out_the_quarantine(source, readers,
                                                                                            monkeypatch):
    """The source's side played by hand: 8 of 16 blocks staged and counted, the rest never counted."""
    monkeypatch.setattr(bounce_module, "BOUNCE_QUARANTINE_S", 0.3)
    bounced, _ = readers
    src, dst = _picks(3, 16)
    block = SRC_LAYOUT.block_bytes
    ranks = []
    for r in range(2):
        arena = source.arenas[r]
        addr = arena.take(40, 16 * block + 8)
        ready = addr + 16 * block
        staged = arena.buffer[addr - arena.base:ready - arena.base]
        for i, b in enumerate(src[r]):
            staged[i * block:(i + 1) * block] = source.pools[r][b * block:(b + 1) * block]
        arena.store_word(ready, 8 if r == 0 else 16)
        ranks.append(RankBlocks(r, src[r], [GatherSlot(0, addr, block, 16, ready, 8)]))
    done = bounced.load(source, ranks, dst, timeout_ms=300)
    assert not done.ok and "source rank 0 staged 8 of 16 blocks" in done.error, done.error
    heads = bounced.dst.reshape(64, SLABS, 2, -1)  # block, slab, head (source rank), bytes
    assert not heads[dst[8:], :, 0].any()  # no byte source rank 0 did not count reached the destination
    for r, blocks in ((0, range(8)), (1, range(16))):  # what was counted landed, byte for byte
        pool = source.pools[r].reshape(64, SLABS, -1)
        assert all(np.array_equal(heads[dst[i], :, r], pool[src[r][i]]) for i in blocks)
    assert bounced.bounce.in_use > 0  # an aborted READ may still land in the range: not handed out yet
    time.sleep(0.35)
    src2, dst2 = _picks(4, 20)
    ok = bounced.load(source, [RankBlocks(r, src2[r]) for r in range(2)], dst2, load_id=2)
    assert ok.ok and bounced.bounce.in_use == 0  # the quarantine ran out when the next load took a range
    for arena in source.arenas:
        arena.filled(40, arena.base)
        arena.release(40)


def _reads(remote: list[int], nbytes: list[int], local: list[int] | None = None) -> SourceReads:
    u = np.uint64
    local = local if local is not None else [0x100000 + 7919 * i * 64 for i in range(len(remote))]
    return SourceReads(0, "a", frozen(np.array(remote, dtype=u)), frozen(np.array(local, dtype=u)),
                       frozen(np.array(nbytes, dtype=u)))


def test_the_rule_bounces_only_many_small_pieces_that_merge():
    adjacent = [0x10000 + 1024 * i for i in range(32)]  # 32 pieces of 1 KiB, back to back on the source
    planned = bounce_plan(_reads(adjacent, [1024] * 32), 0x900000)
    assert planned is not None
    reads, ends, at = planned
    assert reads.num_descriptors == 1 and reads.nbytes.tolist() == [32 * 1024] and ends.tolist() == [32]
    assert at.tolist() == [0x900000 + 1024 * i for i in range(32)]
    assert bounce_plan(_reads(adjacent[:15], [1024] * 15), 0) is None  # too few to be worth it
    big = [0x10000 + 2 * BOUNCE_MAX_PIECE * i for i in range(32)]
    assert bounce_plan(_reads(big, [2 * BOUNCE_MAX_PIECE] * 32), 0) is None  # pieces too large
    scattered = [0x10000 + 4096 * i for i in range(32)]  # 1 KiB pieces 4 KiB apart: nothing merges
    assert bounce_plan(_reads(scattered, [1024] * 32), 0) is None
    region = BounceRegion(16 * 1024)  # room for 16 KiB: a 32 KiB part reads in place
    assert region.land(_reads(adjacent, [1024] * 32)) is None and region.in_use == 0
    assert region.land(_reads(adjacent[:16], [1024] * 16)) is not None and region.in_use == 16 * 1024
