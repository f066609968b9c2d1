"""Smoke test: ``bench.registry.bench_fleet`` with a tiny fleet (20 workers, 1 server, a real redis-server, 3 s phases).

It finishes, and what it reports holds together: the publishers were told
every batch was applied and the server counted exactly those block events;
the registry's entries equal the workers' pools; lookups found holders; the
layout-0 registry mirror holds exactly layout 0's pools; Redis grew by a
positive, plausible amount per entry; the feed reached every follower with
no gap.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _need_redis_binaries

REPO = Path(__file__).resolve().parent.parent
BENCH = "bench.registry.bench_fleet"

pytestmark = pytest.mark.slow


def test_bench_fleet_tiny_run_holds_together(tmp_path: Path) -> None:
    _need_redis_binaries()
    out = tmp_path / "fleet.json"
    proc = subprocess.Popen([sys.executable, "-m", BENCH, "--servers", "1", "--store", "redis", "--workers", "20",
                             "--lookups", "server", "--seconds", "3", "--fill-seconds", "10", "--targets", "1",
                             "--followers", "1", "--churn-per-min", "6", "--json", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the bench stops what it started (finally blocks)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, text[-6000:]

    row = json.loads(out.read_text())["rows"][0]
    assert row["problems"] == []
    assert (row["servers"], row["store"], row["workers"]) == (1, "redis", 20)
    # events: applied > 0, and the server counted exactly what the publishers were told was applied
    assert row["saturated"]["block_events"] > 0 and row["paced"]["block_events"] > 0
    assert row["publisher_applied"] == row["server_events_ingested"] > row["fill_block_events"] > 0
    health = {k: row[k] for k in ("errors", "unknown_worker", "resync_needed", "hb_not_ok", "failovers")}
    assert health == dict.fromkeys(health, 0), health
    # state: every pool in the registry, nothing more (retired incarnations swept)
    assert row["entries"] == row["entries_expected"] > 0 and row["unswept_incarnations"] == 0
    # lookups answered, most with a holder
    for phase in ("saturated", "paced"):
        assert row[phase]["lookups"] > 0 and row[phase]["lookup_errors"] == 0
        assert row[phase]["lookup_hit_rate"] > 0.5 and row[phase]["mean_matched_blocks"] > 1
        assert 0 < row[phase]["lookup_p50_ms"] <= row[phase]["lookup_p99_ms"]
        assert row[phase]["feed_msgs_per_s_per_follower"] > 0
    # memory: Redis grew, by a plausible amount per (hash, holder) entry
    assert 32 < row["bytes_per_entry"] < 2000
    # the feed: one raw follower and the layout-0 mirror, nothing dropped, the mirror exact
    assert row["followers"] == 2 and row["feed_gaps"] == 0
    assert row["mirror"]["ready"] and row["mirror"]["entries"] == row["entries_layout0"] > 0
