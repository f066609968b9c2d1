"""Smoke test of ``bench.identity.bench_weight_digest`` with tiny settings: it runs, and what it reports holds together.

A 20 MB checkpoint, one round, BLAKE3 and SHA-256 in one thread: every row
(the plain read too, cold and warm) has a positive throughput, the digest
cache's second call hits every file, the 16 GB extrapolation is filled in,
and nothing is left under /var/tmp.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _bench_dirs() -> set[Path]:
    return set(Path("/var/tmp").glob("bench-weight-digest-*"))


def test_bench_weight_digest_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "wd.json"
    before = _bench_dirs()
    proc = subprocess.run([sys.executable, "-m", "bench.identity.bench_weight_digest", "--gb", "0.02", "--rounds", "1",
                           "--algorithms", "blake3,sha256", "--threads", "1", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    assert "first start for a 16 GB checkpoint" in proc.stdout
    result = json.loads(out.read_text())
    assert {"config", "machine", "write", "rows", "hash_in_memory_gbps", "digest_cache",
            "extrapolation_16gb"} <= set(result)
    assert result["config"]["shards"] >= 2 and 0.019e9 < result["config"]["bytes"] <= 0.021e9
    assert {"cpu_model", "nproc", "date", "commit"} <= set(result["machine"])

    rows = {(r["algorithm"], r["threads"], r["cache"]): r for r in result["rows"]}
    assert set(rows) == {(a, 1, c) for a in ("read", "blake3", "sha256") for c in ("cold", "warm")}
    for r in rows.values():
        assert len(r["samples_gbps"]) == 1
        assert 0 < r["gbps"]["min"] <= r["gbps"]["median"] <= r["gbps"]["max"]
        assert r["seconds"]["median"] > 0
    assert rows[("blake3", 1, "cold")]["digest"] == rows[("blake3", 1, "warm")]["digest"]
    assert rows[("blake3", 1, "cold")]["digest"] != rows[("sha256", 1, "cold")]["digest"]
    assert all(v["median"] > 0 for v in result["hash_in_memory_gbps"].values())

    cache = result["digest_cache"]
    assert cache["all_hits"] and cache["miss_files_cached"] == 0
    assert cache["miss_bytes_read"] == result["config"]["bytes"]
    assert 0 < cache["hit_s"]["median"] and cache["miss_s"] > 0
    extra = result["extrapolation_16gb"]
    assert extra["cold_s"] > 0 and extra["warm_s"] > 0 and extra["restart_ms"] > 0

    assert _bench_dirs() <= before, "the bench left its temporary directories behind"
