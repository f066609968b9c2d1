"""Smoke test of ``bench.source.bench_source_progress`` with tiny settings: it runs, and what it reports holds together.

Two sources of 4 MiB over UCX TCP, one round, both progress modes, 2 timed
READs each: every run checked its bytes, moved something, has a read and
an idle CPU figure per source, and the event/poll ratio is filled in.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = "bench.source.bench_source_progress"

pytestmark = pytest.mark.slow


def test_bench_source_progress_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "progress.json"
    proc = subprocess.Popen([sys.executable, "-m", BENCH, "--mib", "4", "--reps", "2", "--rounds", "1", "--sources", "2",
                             "--fabrics", "tcp", "--modes", "event,poll", "--idle-s", "0.5", "--json", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the bench kills its sources and reader on the way out
            proc.communicate(timeout=30)
    assert proc.returncode == 0, text[-6000:]
    assert "event/poll" in text

    result = json.loads(out.read_text())
    assert result["ucx_tls"] == {"tcp": "tcp"}
    assert {"nproc", "loadavg_before", "loadavg_after", "date", "commit", "dirty"} <= set(result["machine"])
    runs = result["runs"]
    assert sorted(r["mode"] for r in runs) == ["event", "poll"]
    for r in runs:
        assert (r["fabric"], r["ucx_tls"], r["sources"], r["block_kib"]) == ("tcp", "tcp", 2, 64)
        assert r["bytes_per_rep"] == 2 * (4 << 20) and r["descriptors_per_source"] == 64
        assert r["bytes_checked"] == {"warmup": True, "last_read": True}
        assert len(r["rep_s"]) == 2 and all(s > 0 for s in r["rep_s"]) and r["gbps"] > 0
        for key in ("read_cpu_pct", "idle_cpu_pct", "read_window_s", "idle_window_s"):
            assert len(r[key]) == 2 and all(v >= 0 for v in r[key]), (key, r[key])
        assert all(w >= 0.4 for w in r["idle_window_s"])
    assert next(r for r in runs if r["mode"] == "poll")["poll_interval_s"] == 0.0002  # TCP: the emulated pace

    rows = {r["mode"]: r for r in result["rows"]}
    assert set(rows) == {"event", "poll"}
    for row in rows.values():
        assert row["bytes_checked"] and row["rounds"] == 1
        assert 0 < row["gbps"]["min"] <= row["gbps"]["median"] <= row["gbps"]["max"]
        assert row["read_cpu_pct_per_source"]["median"] >= 0 and row["idle_cpu_pct_per_source"]["median"] >= 0
    [ratio] = result["event_over_poll"]
    assert ratio["event_over_poll_gbps"]["median"] > 0 and len(ratio["per_round"]) == 1
