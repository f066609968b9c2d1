"""One target rank's data path (``RankWorker``) over the same-process ``memcpy`` adapter.

The memcpy adapter copies inside ``start_read``, as NIXL does on one host
(UCX ``cma``), so these tests pin down what the rank's loop relies on: a load
whose bytes landed inside the post is reported by ``start`` itself — not
after whatever the loop starts next — and every load is reported exactly
once, with nothing posted after its deadline.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from source_procs.pattern import make_layout

from remote_g2.adapters.memcpy_transfer import MemcpyTransfer
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.protocol.messages import RankBlocks, RankInfo, TargetDone, TargetLoad
from remote_g2.target.rank_worker import RankWorker

LAYOUT = make_layout(num_blocks=16, num_kv_heads=2)
BB = LAYOUT.block_bytes
SOURCE = "rank-worker-test-src-tp0"


@pytest.fixture()
def rig():
    src = np.random.default_rng(3).integers(0, 256, 16 * BB, dtype=np.uint8)
    dst = np.zeros(16 * BB, dtype=np.uint8)
    MemcpyTransfer.expose(SOURCE, [MemoryRegion(src.ctypes.data, src.nbytes)])
    transfer = MemcpyTransfer("rank-worker-test-dst-tp0")
    transfer.register_local([MemoryRegion(dst.ctypes.data, dst.nbytes)])
    reports: list[TargetDone] = []
    worker = RankWorker(rank=0, tp_size=1, layout=LAYOUT, pool_base=dst.ctypes.data, transfer=transfer,
                        report=reports.append)
    info = RankInfo(0, SOURCE, b"memcpy", src.ctypes.data, src.nbytes, LAYOUT)
    try:
        yield src, dst, worker, reports, info
    finally:
        worker.close()
        MemcpyTransfer.unexpose(SOURCE)


def _load(load_id: int, info: RankInfo, src_ids: list[int], dst_ids: list[int], *, timeout_ms: int = 5000,
          deadline_ns: int = 0) -> TargetLoad:
    return TargetLoad(load_id, "src-worker", 1, 1, False, 0, [RankBlocks(0, src_ids)], [info], dst_ids, timeout_ms,
                      deadline_ns or time.monotonic_ns() + timeout_ms * 1_000_000)


def test_a_load_that_landed_inside_the_post_is_reported_by_start_itself(rig) -> None:
    src, dst, worker, reports, info = rig
    worker.start(_load(1, info, [3, 9, 4], [0, 1, 2]), time.monotonic())
    assert [(d.load_id, d.ok, d.nbytes) for d in reports] == [(1, True, 3 * BB)]
    assert not worker.busy  # nothing left for poll()
    for i, s in enumerate([3, 9, 4]):
        assert np.array_equal(dst[i * BB:(i + 1) * BB], src[s * BB:(s + 1) * BB])


def test_loads_started_back_to_back_are_each_reported_before_the_next_starts(rig) -> None:
    src, dst, worker, reports, info = rig
    for load_id, s in ((1, 5), (2, 6), (3, 7)):
        worker.start(_load(load_id, info, [s], [load_id]), time.monotonic())
        assert [d.load_id for d in reports] == list(range(1, load_id + 1))  # this one is in already
    assert all(d.ok for d in reports)
    assert np.array_equal(dst[3 * BB:4 * BB], src[7 * BB:8 * BB])


def test_a_load_past_its_deadline_is_reported_failed_and_nothing_lands(rig) -> None:
    src, dst, worker, reports, info = rig
    worker.start(_load(1, info, [2], [0], deadline_ns=time.monotonic_ns() - 1_000_000), time.monotonic())
    assert len(reports) == 1 and not reports[0].ok and "deadline" in reports[0].error
    assert not dst.any()


def test_a_bad_plan_is_reported_failed_once_and_the_worker_goes_on(rig) -> None:
    src, dst, worker, reports, info = rig
    worker.start(_load(1, info, [99], [0]), time.monotonic())  # source block 99 does not exist
    worker.start(_load(2, info, [1], [1]), time.monotonic())
    assert [(d.load_id, d.ok) for d in reports] == [(1, False), (2, True)]
    assert "block id 99" in reports[0].error
    assert np.array_equal(dst[BB:2 * BB], src[BB:2 * BB]) and not dst[:BB].any()


def test_a_restarted_source_is_planned_against_its_new_pool_not_the_kept_planner(rig) -> None:
    # The worker keeps one planner per source; a new epoch (the source restarted, here with its pool
    # elsewhere and its blocks in other places) must drop it, or READs would use the old addresses.
    src, dst, worker, reports, info = rig
    worker.start(_load(1, info, [3], [0]), time.monotonic())
    moved = np.random.default_rng(9).integers(0, 256, 16 * BB, dtype=np.uint8)
    MemcpyTransfer.unexpose(SOURCE)
    MemcpyTransfer.expose(SOURCE, [MemoryRegion(moved.ctypes.data, moved.nbytes)])
    new_info = RankInfo(0, SOURCE, b"memcpy", moved.ctypes.data, moved.nbytes, LAYOUT)
    load = _load(2, new_info, [3], [1])
    worker.start(TargetLoad(**{**{f: getattr(load, f) for f in load.__slots__}, "source_epoch": 2}),
                 time.monotonic())
    assert [(d.load_id, d.ok) for d in reports] == [(1, True), (2, True)]
    assert np.array_equal(dst[:BB], src[3 * BB:4 * BB])
    assert np.array_equal(dst[BB:2 * BB], moved[3 * BB:4 * BB])  # from the new pool


def _keep_handles(worker: RankWorker) -> list:
    """Every READ handle the worker's adapter hands out from now on."""
    handles: list = []
    post = worker._transfer.start_read

    def keep(*a, **kw):
        handles.append(post(*a, **kw))
        return handles[-1]

    worker._transfer.start_read = keep
    return handles


def test_a_done_loads_handles_are_freed_after_its_report_when_the_loop_asks(rig) -> None:
    # The report goes out first; the handles wait for release_retired (the leader's coordinator shares
    # a CPU with the share thread, so the free is kept off the report's path), and close() frees any left.
    src, dst, worker, reports, info = rig
    handles = _keep_handles(worker)
    worker.start(_load(1, info, [3], [0]), time.monotonic())
    assert [(d.load_id, d.ok) for d in reports] == [(1, True)]
    assert worker.retired and not any(h.released for h in handles)
    worker.release_retired()
    assert not worker.retired and all(h.released for h in handles)
    worker.start(_load(2, info, [4], [1]), time.monotonic())
    assert worker.retired
    worker.close()
    assert all(h.released for h in handles)


def test_a_failed_loads_reads_are_released_before_it_is_reported(rig) -> None:
    src, dst, worker, reports, info = rig
    released_at_report: list[bool] = []
    handles = _keep_handles(worker)
    worker._transfer.poll = lambda h: "error"  # the READ ended in ERR
    worker._report = lambda done: released_at_report.append(all(h.released for h in handles))
    worker.start(_load(1, info, [3], [0]), time.monotonic())
    assert released_at_report == [True] and not worker.retired
