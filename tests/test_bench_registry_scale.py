"""Smoke tests of the registry-scale benches with tiny settings: they run, and what they report holds together.

``bench.registry.bench_ingest``: real publishers into a real ``remote-g2 serve``
(embedded store), the server's counter moved and the registry holds exactly
the pools. ``bench.registry.bench_mirror_scale``: the mirror's copy of 100 k
hashes stays within its memory bound and answers every lookup whole.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(args: list[str], timeout_s: float) -> str:
    proc = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    return proc.stdout


def test_bench_ingest_tiny_run_loses_nothing(tmp_path: Path) -> None:
    out = tmp_path / "ingest.json"
    _run(["-m", "bench.registry.bench_ingest", "--stores", "memory", "--publishers", "2", "--pool", "4096", "--chunk", "64",
          "--batch", "512", "--seconds", "1", "--json", str(out)], 120)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["store"] == "memory" and row["events"] > 0 and row["events_per_s"] > 0
    assert row["flushed"] and row["nothing_lost"] and row["resyncs"] == 0
    assert 0 < row["registry_entries"] == row["pools_hold"] <= 2 * 4096  # every pool block, each exactly once


def test_bench_mirror_scale_tiny_run_stays_small(tmp_path: Path) -> None:
    out = tmp_path / "mirror.json"
    _run(["-m", "bench.registry.bench_mirror_scale", "--hashes", "100000", "--no-dynamo", "--lookups", "200", "--rounds", "2",
          "--json", str(out)], 120)
    result = json.loads(out.read_text())
    assert result["hashes"] == 100_000 - 100_000 % 128 and result["entries"] == 2 * result["hashes"]
    assert 16 <= result["memory"]["index_nbytes_per_hash"] <= 40
    (lat,) = result["latency"].values()
    assert lat["n"] == 400 and 0 < lat["p50_us"] <= lat["p99_us"]
