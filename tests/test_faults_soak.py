"""Load under eviction: concurrent NIXL readers against a TP=2 source whose small pool keeps evicting.

A bounded version of ``bench/source/bench_soak.py`` (issue 8, load): each rank of a
synthetic source holds 128 one-KiB blocks while a churn thread stores runs of
hashes from a key space of 256 at 2,000 hashes/s — every rank its own runs
(``--churn-rank-seeds``), so ranks evict different blocks and resolves get
trimmed to what both hold. Four reader processes run 150 cycles each:
resolve a random window of 8, READ every matched block from both ranks with
real NIXL, check every byte, release. The pin contract under test: a pinned
block is never evicted or rewritten, so every byte read matches, and every
lease's pins are gone once its reader released it.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from source_procs.harness import SourceWorker, have_mpiexec
from source_procs.soak_reader import run_soak_readers

pytestmark = [
    pytest.mark.slow,
    pytest.mark.mpi,
    pytest.mark.nixl,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not in the venv (pip install mpich)"),
]

CLIENTS, CYCLES, WINDOW = 4, 150, 8
NUM_BLOCKS, KEY_SPACE = 128, 256


def test_readers_under_eviction_read_only_right_bytes_and_leave_no_pins(tmp_path: Path) -> None:
    worker = SourceWorker(tmp_path / "source", f"soak-{os.getpid()}", args=[
        "--num-blocks", str(NUM_BLOCKS), "--hashes", str(NUM_BLOCKS), "--budget", str(CLIENTS * WINDOW),
        "--churn-hashes", str(KEY_SPACE), "--churn-per-s", "2000", "--churn-batch", "8", "--churn-rank-seeds",
        "--lifetime-s", "150"])
    try:
        readers = run_soak_readers(worker.endpoint, tmp_path / "readers", CLIENTS, key_space=KEY_SPACE,
                                   window=WINDOW, cycles=CYCLES, seconds=60)
        # Releases reach rank 1 asynchronously; well inside the 30 s lease TTL, so expiry cannot hide a leak.
        after = [worker.wait_state(r, lambda s: s["total_pins"] == 0 and s["service"]["leases_open"] == 0,
                                   timeout_s=5.0, what="no pins and no open leases after the last release")
                 for r in (0, 1)]
        report = worker.stop()
    finally:
        worker.kill()

    for r in readers:
        summary = {k: r[k] for k in ("cycles", "full", "partial", "empty", "over_budget", "errors", "wrong_bytes")}
        assert r["wrong_bytes"] == 0 and r["mismatches"] == [], (summary, r["mismatches"])
        assert r["errors"] == 0 and r["over_budget"] == 0, (summary, r["error_samples"], r["output"])
        assert r["cycles"] == CYCLES == r["full"] + r["partial"] + r["empty"], summary
    assert sum(r["blocks_verified"] for r in readers) > 0  # bytes were really read and checked
    assert sum(r["partial"] + r["empty"] for r in readers) > 0  # clean misses: eviction reached the readers
    for rank, state in enumerate(after):
        assert state["evictions"] > 0, (rank, state)
        assert state["churn"]["errors"] == 0 and state["churn"]["stores"] > 0, (rank, state["churn"])
    assert all(d["total_pins"] == 0 for d in report["done"].values()), report
