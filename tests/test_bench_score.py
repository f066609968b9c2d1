"""Smoke test of ``bench.scoring.bench_score`` with tiny settings: it runs against a real server, and what it
reports holds together (every prompt scored, the long prompts' scores equal to the whole-prompt baseline's,
which the bench itself checks)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def test_bench_score_tiny_run(tmp_path: Path) -> None:
    out = tmp_path / "score.json"
    proc = subprocess.run([sys.executable, "-m", "bench.scoring.bench_score", "--workers", "4", "--hashes", "4000",
                           "--tokens", "512", "--prompts", "4", "--requests", "40", "--long-tokens", "4096",
                           "--long-requests", "4", "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]
    doc = json.loads(out.read_text())
    assert doc["requests"] == 40 and doc["workers"] == 4 and 0 < doc["p50_ms"] <= doc["p99_ms"]
    assert doc["scores_per_server_cpu_s"] > 0 and doc["entries"] > 0
    long = doc["long_prompts"]
    assert long["tokens"] == 4096 and long["requests"] == 4 and long["p50_ms"] > 0 and long["whole_prompt_p50_ms"] > 0
    assert 0 < long["best_matched_tokens"] <= 1024
    assert "scores / s of server CPU" in proc.stdout and "every prompt hashed whole" in proc.stdout
