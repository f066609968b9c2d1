"""Smoke test: ``bench.transfer.bench_transfer --netns`` across three network namespaces over UCX TCP.

A tiny run (4 MiB, 1 MiB blocks, 2 reps, no streams): it finishes, the bytes
it read crossed the source host's link (not shared memory), the source left
at its default bind advertised its subnet address, every pin came back, and
no namespace of the bench is left behind. Needs root (skipped otherwise).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from remote_g2.adapters.reference.netns import list_netns, netns_unavailable_reason

REPO = Path(__file__).resolve().parent.parent
BENCH = "bench.transfer.bench_transfer"

_WHY_NOT = netns_unavailable_reason()
pytestmark = [pytest.mark.mpi, pytest.mark.nixl, pytest.mark.slow,
              pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")]


def test_bench_transfer_across_namespaces(tmp_path: Path) -> None:
    out = tmp_path / "netns.json"
    proc = subprocess.Popen([sys.executable, "-m", BENCH, "--netns", "--blocks-kib", "1024", "--mib", "4",
                             "--reps", "2", "--stream-requests", "0", "--timeout-s", "90", "--json", str(out)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            proc.terminate()  # the bench stops its workers and removes its namespaces
            proc.communicate(timeout=60)
    assert proc.returncode == 0, text[-6000:]
    assert not [ns for ns in list_netns() if ns.startswith(f"rg2-{proc.pid}-")], "namespaces left behind"

    data = json.loads(out.read_text())
    assert data["netns"] is not None and data["ucx_tls"] == "tcp"
    row = data["rows"][0]
    source_host = data["netns"]["source"]
    assert row["source_endpoint"]["endpoint"].startswith(f"tcp://{source_host}:"), row["source_endpoint"]
    assert row["pins_after"] == [0, 0]
    assert row["e2e_s"] > 0 and row["raw_s"] > 0 and row["first_contact_s"] > 0
    # every byte read crossed the veth (TCP), none went through shared memory
    assert row["source_link_sent"] >= row["bytes_read"], (row["source_link_sent"], row["bytes_read"])
    assert "first contact" in text and "across network namespaces" in text
