"""A source worker whose ranks are not MPI ranks: the start-up exchange over a real ``torch.distributed`` group.

vLLM's workers are joined by ``torch.distributed``, not MPI. Two plain
processes (no mpiexec) join a gloo group and start their source services
with :class:`remote_g2.tp.torch_group.TorchGroupComm` as the TP group's
communicator; a reader then resolves on both ranks through rank 0 and reads
every byte back over real NIXL.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from source_procs.harness import SourceWorker, run_readers
from source_procs.pattern import hash_of

from remote_g2.errors import ConfigError
from remote_g2.protocol.messages import GetMetadata, Release, Resolve
from remote_g2.rpc.client import RpcClient

torch_dist = pytest.importorskip("torch.distributed")

pytestmark = [pytest.mark.nixl]


def test_a_tp2_source_starts_over_a_torch_group_and_serves_exact_bytes(tmp_path: Path) -> None:
    worker = SourceWorker(tmp_path / "src", f"torch-{os.getpid()}", launcher="torch")
    try:
        with RpcClient(worker.endpoint, timeout_ms=5000) as client:
            meta = client.call(GetMetadata())
            assert meta.tp_size == 2 and [r.rank for r in meta.ranks] == [0, 1]
            assert all(r.agent_name.endswith(f"-tp{r.rank}") for r in meta.ranks)
            lease = client.call(Resolve([hash_of(i) for i in range(6)], 10_000))
            assert (lease.reason, lease.matched) == ("ok", 6)
            worker.wait_pins(0, 6)
            worker.wait_pins(1, 6)
            assert client.call(Release(lease.lease_id)).released
        [result] = run_readers(worker.endpoint, tmp_path, [{"hashes": 8, "loops": 2}])
        assert result["ok"] and result["mismatches"] == [], result
        report = worker.stop()
        assert all(d["total_pins"] == 0 for d in report["done"].values()), report
    finally:
        worker.kill()


def test_without_an_initialized_group_the_error_says_what_to_do() -> None:
    from remote_g2.tp.torch_group import TorchGroupComm

    if torch_dist.is_initialized():  # pragma: no cover - this process never joins one
        pytest.skip("this process has a torch.distributed group")
    with pytest.raises(ConfigError, match="init_process_group"):
        TorchGroupComm()
