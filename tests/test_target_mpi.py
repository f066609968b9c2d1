"""The target client in real processes: a ``mpiexec -n S`` source, a ``mpiexec -n T`` target, real NIXL READs.

A registry (memory store, in this process) tracks the synthetic source
(``tests/source_procs/source_rank.py``: 2 kv heads per source rank, hashes
``hash_of(0..31)``). The target ranks (``tests/source_procs/target_rank.py``)
look up, load into destination blocks 5.. with their own NIXL agents, and
check every byte of every destination block against the source ranks'
patterns mapped through the TP head slices; blocks outside the load must stay
untouched. Afterwards the source's pin counts are back to zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from source_procs.harness import MPIEXEC, SourceWorker, have_mpiexec

from remote_g2.registry import MemoryStore, RegistryClient, RegistryServer

pytestmark = [
    pytest.mark.mpi,
    pytest.mark.nixl,
    pytest.mark.skipif(not have_mpiexec(), reason="mpiexec is not in the venv (pip install mpich)"),
]

TARGET_SCRIPT = Path(__file__).resolve().parent / "source_procs" / "target_rank.py"


@pytest.fixture
def registry() -> Iterator[str]:
    server = RegistryServer(MemoryStore(lease_ttl_ms=5000), bind="tcp://127.0.0.1:0")
    try:
        yield server.start()
    finally:
        server.close()


def _source(tmp_path: Path, registry: str, source_tp: int, name: str) -> SourceWorker:
    worker = SourceWorker(tmp_path / f"src-{name}", f"src-{name}-{os.getpid()}", np=source_tp,
                          args=["--registry", registry])
    with RegistryClient(registry) as reg:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            rec = reg.worker_info(worker.worker_id)
            if rec is not None and rec.blocks == 32:
                return worker
            time.sleep(0.05)
    worker.stop()
    raise AssertionError("the source never showed its 32 blocks in the registry")


def _run_target(tmp_path: Path, registry: str, *, tp: int, source_tp: int, hashes: int = 16,
                timeout_ms: int = 5000, wait_s: float = 30.0) -> tuple[dict, list[dict]]:
    d = tmp_path / f"tgt-{tp}"
    d.mkdir()
    ipc = tempfile.mkdtemp(prefix="rg2t-")  # pytest's tmp paths are too long for a unix socket path
    cmd = [str(MPIEXEC), "-n", str(tp), sys.executable, str(TARGET_SCRIPT), "--dir", str(d), "--registry", registry,
           "--hashes", str(hashes), "--source-tp", str(source_tp), "--total-heads", str(2 * source_tp),
           "--timeout-ms", str(timeout_ms), "--wait-s", str(wait_s), "--ipc-dir", ipc]
    env = {**os.environ, "UCX_LOG_LEVEL": "fatal"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=wait_s + 60, env=env,
                          cwd=Path(__file__).resolve().parents[1])
    log = proc.stdout[-3000:] + proc.stderr[-3000:]
    # NIXL has been seen to crash at interpreter exit; results are written before that.
    assert (d / "leader.json").exists(), log
    leader = json.loads((d / "leader.json").read_text())
    assert "error" not in leader, leader["error"]
    verify = []
    for r in range(tp):
        path = d / f"verify-{r}.json"
        assert path.exists(), f"rank {r} wrote no verification\n{log}"
        verify.append(json.loads(path.read_text()))
    return leader, verify


@pytest.mark.parametrize(("source_tp", "target_tp"), [(2, 2), (1, 2), (2, 1), (2, 4)])
def test_load_is_byte_exact_on_every_rank_and_pins_return_to_zero(tmp_path: Path, registry: str,
                                                                  source_tp: int, target_tp: int) -> None:
    source = _source(tmp_path, registry, source_tp, f"{source_tp}to{target_tp}")
    try:
        leader, verify = _run_target(tmp_path, registry, tp=target_tp, source_tp=source_tp)
        assert leader["match"] == {"matched": 16, "reason": "ok", "worker_id": source.worker_id}
        assert leader["done"] == ["req-1"] and leader["failed"] == [] and leader["invalid"] == []
        for r, v in enumerate(verify):
            assert v["checked"] == 16 and v["mismatches"] == [], (r, v)
            assert v["untouched_written"] == [], (r, v)
        for r in range(source_tp):
            source.wait_pins(r, 0)
    finally:
        report = source.stop()
    assert all(d["total_pins"] == 0 for d in report["done"].values()), report
