"""The vLLM connector's saver: G2 copies off the engine's thread (torch and a real HostPool; no vLLM needed)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from remote_g2.adapters.host_pool import HostPool
from remote_g2.adapters.vllm.kv_blocks import VllmKvLayout
from remote_g2.adapters.vllm.saver import BlockSaver, SaveJob

B, H, N, D = 8, 2, 16, 8


def _kv() -> tuple[VllmKvLayout, dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    caches = {f"model.layers.{i}.attn": torch.randn(B, H, N, 2 * D, generator=gen) for i in range(3)}
    return VllmKvLayout.from_kv_caches(caches, block_size=N), caches


def _h(i: int) -> bytes:
    return bytes([i]) * 32


class _Gate:
    """A copy hook that holds each job until the test lets it go, and says when a job reached it."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.go = threading.Event()
        self.jobs: list[SaveJob] = []

    def __call__(self, job: SaveJob) -> None:
        self.jobs.append(job)
        self.reached.set()
        assert self.go.wait(10)


@contextmanager
def _gated_saver(kv: VllmKvLayout, pool: HostPool) -> Iterator[tuple[BlockSaver, _Gate]]:
    """A saver whose jobs each wait at the gate between gather and store; let go and closed at the end."""
    gate = _Gate()
    saver = BlockSaver(kv, pool, copy_hook=gate)
    try:
        yield saver, gate
    finally:
        gate.go.set()
        saver.close()


def test_submit_returns_before_the_copy_and_the_pool_has_nothing_until_it_ended() -> None:
    kv, _ = _kv()
    pool = HostPool(kv.g2_layout(16))
    stored: list[list[bytes]] = []
    pool.add_listener(lambda kind, hashes: stored.append(list(hashes)) if kind == "stored" else None)
    with _gated_saver(kv, pool) as (saver, gate):
        t0 = time.perf_counter()
        job = saver.submit(["r1", "r1"], [_h(1), _h(2)], [3, 5])
        assert job is not None and time.perf_counter() - t0 < 1.0
        assert gate.reached.wait(10)
        # gathered, not stored: nobody can find these hashes, nothing was published, the request is pending
        assert pool.lookup(_h(1)) is None and stored == [] and saver.pending("r1")
        gate.go.set()
        assert saver.wait_for(["r1"], timeout_s=10)
        assert not saver.pending("r1") and stored == [[_h(1), _h(2)]]
        rows = kv.pool_view(pool.tensor)
        expect = kv.gather([3, 5])
        assert torch.equal(rows[pool.lookup(_h(1))], expect[0]) and torch.equal(rows[pool.lookup(_h(2))], expect[1])


def test_hashes_in_g2_or_in_a_queued_job_are_not_copied_again() -> None:
    kv, _ = _kv()
    pool = HostPool(kv.g2_layout(16))
    with _gated_saver(kv, pool) as (saver, gate):
        first = saver.submit(["a", "a"], [_h(1), _h(2)], [0, 1])
        # the same hash twice in one step, one in flight, and a new one: one job with the new one only
        second = saver.submit(["b", "b", "b"], [_h(2), _h(3), _h(3)], [1, 2, 2])
        assert first is not None and second is not None
        assert second.hashes == [_h(3)] and second.block_ids == [2] and second.request_ids == ["b"]
        gate.go.set()
        assert saver.wait_for(["a", "b"], timeout_s=10)
        assert saver.submit(["c"], [_h(1)], [4]) is None  # in G2 now
        assert not saver.pending("c")
        assert saver.blocks_saved == 3 and saver.jobs_done == 2


def test_a_dropped_job_stores_nothing_and_wait_for_times_out_while_a_copy_hangs() -> None:
    kv, _ = _kv()
    pool = HostPool(kv.g2_layout(16))
    with _gated_saver(kv, pool) as (saver, gate):
        saver.submit(["victim"], [_h(7)], [6])
        assert gate.reached.wait(10)
        assert not saver.wait_for(["victim"], timeout_s=0.2)  # the copy is held: the wait gives up
        saver.drop(["victim"])
        gate.go.set()
        assert saver.wait_for(["victim"], timeout_s=10)
        assert pool.lookup(_h(7)) is None and saver.blocks_saved == 0 and saver.idle()
        # the saver goes on serving later jobs
        saver.submit(["next"], [_h(8)], [6])
        assert saver.wait_for(["next"], timeout_s=10) and pool.lookup(_h(8)) is not None


def test_a_failing_store_loses_the_blocks_not_the_thread() -> None:
    kv, _ = _kv()
    pool = HostPool(kv.g2_layout(2))
    pinned = pool.store([_h(1), _h(2)], list(kv.gather([0, 1])))
    pool.pin_blocks_by_id(pinned)  # every block pinned by a reader: no room for a new one
    saver = BlockSaver(kv, pool)
    try:
        saver.submit(["r"], [_h(3)], [2])
        assert saver.wait_for(["r"], timeout_s=10) and pool.lookup(_h(3)) is None
        pool.unpin_blocks_by_id(pinned)
        saver.submit(["s"], [_h(4)], [3])
        assert saver.wait_for(["s"], timeout_s=10) and pool.lookup(_h(4)) is not None
    finally:
        saver.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA copy path (side stream, event) needs a GPU")
def test_cuda_blocks_are_copied_on_a_side_stream_after_the_steps_compute() -> None:
    kv_cpu, caches = _kv()
    dev = {name: t.cuda() for name, t in caches.items()}
    kv = VllmKvLayout.from_kv_caches(dev, block_size=N)
    pool = HostPool(kv.g2_layout(16))
    saver = BlockSaver(kv, pool)
    try:
        for t in dev.values():  # the "step's compute": writes the blocks on the engine's stream
            t.mul_(2.0)
        saver.submit(["r"], [_h(1)], [3])
        assert saver.wait_for(["r"], timeout_s=10)
        got = kv.pool_view(pool.tensor)[pool.lookup(_h(1))]
        assert torch.equal(got, kv_cpu.gather([3])[0] * 2.0)
        # and back: G2 rows into other device blocks, on the engine's stream
        kv.scatter([0, 6], kv.pool_view(pool.tensor)[torch.as_tensor([pool.lookup(_h(1))] * 2)])
        assert torch.equal(kv.gather([0, 6]), kv.gather([3, 3]))
    finally:
        saver.close()


def test_landed_blocks_are_kept_from_their_slots_and_wait_job_says_when_the_slots_are_free() -> None:
    kv, _ = _kv()
    pool = HostPool(kv.g2_layout(16), reserved_blocks=4)  # blocks 12..15 are landing slots
    rows = kv.pool_view(pool.tensor)
    landed = kv.gather([1, 2])
    rows[12], rows[13] = landed[0], landed[1]
    pool.store([_h(9)], list(kv.gather([0])))
    with _gated_saver(kv, pool) as (saver, gate):
        assert saver.submit_landed([_h(9)], [14]) is None  # G2 holds it already: nothing to keep
        job = saver.submit_landed([_h(1), _h(2)], [12, 13])
        assert job is not None and job.hashes == [_h(1), _h(2)]
        assert saver.wait_job(job, timeout_s=10)  # host to host: no copy hook, no engine's blocks read
        assert torch.equal(rows[pool.lookup(_h(1))], landed[0]) and torch.equal(rows[pool.lookup(_h(2))], landed[1])
        assert pool.lookup(_h(1)) < 12 and pool.lookup(_h(2)) < 12  # into the cache proper, not the slots


def test_seen_blocks_make_a_leading_run_eligible_once_seen_in_threshold_requests() -> None:
    from remote_g2.adapters.vllm.seen_blocks import SeenBlocks

    every = SeenBlocks(1)
    assert every.count([_h(1), _h(2)]) == 2 and len(every) == 0  # threshold 1 keeps nothing
    twice = SeenBlocks(2, capacity=4)
    assert twice.count([_h(1), _h(2), _h(3)]) == 0
    assert twice.count([_h(1), _h(2), _h(4)]) == 2  # 1 and 2 seen twice; 4 once, and nothing after it counts
    assert twice.count([_h(1), _h(5)]) == 1
    assert len(twice) == 4  # capacity: _h(3), seen longest ago, was dropped
    assert twice.count([_h(3)]) == 0
    with pytest.raises(ValueError):
        SeenBlocks(0)


def test_gather_into_copies_what_gather_does_without_torch() -> None:
    import numpy as np

    kv, _ = _kv()
    out = np.zeros(3 * kv.block_bytes, dtype=np.uint8)
    assert kv.gather_into([5, 0, 7], out)
    want = kv.gather([5, 0, 7])
    assert np.array_equal(out, want.reshape(-1).view(torch.uint8).numpy())
    with pytest.raises(ValueError):
        kv.gather_into([1], np.zeros(kv.block_bytes + 1, dtype=np.uint8))


def test_scatter_rows_writes_what_scatter_does_without_torch() -> None:
    kv, caches = _kv()
    twin, twin_caches = _kv()
    pool = HostPool(kv.g2_layout(6))
    rows = kv.pool_view(pool.tensor)
    rows.copy_(torch.randn(rows.shape, generator=torch.Generator().manual_seed(1)))
    assert kv.scatter_rows([3, 6, 1], pool.tensor, [4, 0, 5])
    twin.scatter([3, 6, 1], rows[torch.tensor([4, 0, 5])])
    for name in caches:
        assert torch.equal(caches[name], twin_caches[name])
    assert torch.equal(kv.gather([3, 6, 1]), rows[torch.tensor([4, 0, 5])])
    before = {n: t.clone() for n, t in caches.items()}
    for bad in (lambda: kv.scatter_rows([1], pool.tensor, [6]),  # past the pool
                lambda: kv.scatter_rows([B], pool.tensor, [0]),  # past vLLM's blocks
                lambda: kv.scatter_rows([1, 2], pool.tensor, [0])):
        with pytest.raises(ValueError):
            bad()
    assert all(torch.equal(before[n], caches[n]) for n in caches)  # nothing written by a refused call
