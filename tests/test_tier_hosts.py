"""The vLLM tier's holder side across hosts: a ChunkServer on one network namespace, a reader on another.

The hosts are Linux network namespaces on one box (:mod:`remote_g2.adapters.reference.netns`), with
``UCX_TLS=tcp`` on both sides (all namespaces share one kernel: UCX would otherwise move the bytes through
shared memory). The reader resolves
at the holder's wildcard-bound endpoint, READs the rows with NIXL over UCX's TCP transport (an emulated READ: the
holder's agent makes progress while the lease is open), gets the holder's bytes, and releases. The holder then
refuses it the chunk table (its READs need the holder's progress; one-sided lookups would hang on an idle
holder), so a reader on another host keeps resolving over RPC. The link counters check that the bytes crossed.

No vLLM here: a validated holder needs no engine step (adapters/vllm_tier/serving.py). Needs root (skipped with
the reason otherwise; CI runs as root).
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import pytest

from remote_g2.adapters.reference.netns import Hosts, netns_unavailable_reason, remove_stale

_WHY_NOT = netns_unavailable_reason()

pytestmark = [pytest.mark.nixl,
              pytest.mark.skipif(_WHY_NOT is not None, reason=f"multi-host tests: {_WHY_NOT}")]

ROW = 256 * 1024
UCX_TCP = {"UCX_TLS": "tcp", "UCX_LOG_LEVEL": "error"}

_HOLDER = r"""
import sys, numpy as np
from remote_g2.adapters.vllm_tier.serving import ChunkServer
row = int(sys.argv[1])
region = (np.arange(8 * row, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8).reshape(8, row)
s = ChunkServer("holder", region.ctypes.data, row, 8, bind="tcp://0.0.0.0:0", validated=True)
s.held([bytes([i + 1]) * 32 for i in range(4)], [5, 1, 2, 7])
print("PORT", s.endpoint.rsplit(":", 1)[1], flush=True)
sys.stdin.read()  # until the test closes our stdin
s.close()
"""

_READER = r"""
import json, sys, time, numpy as np
from remote_g2.adapters.nixl_transfer import NixlTransfer
from remote_g2.protocol.messages import ChunkTable, Release, Resolve
from remote_g2.rpc.client import RpcClient
from remote_g2.memory.secondary_pool import MemoryRegion
endpoint, row = sys.argv[1], int(sys.argv[2])
want = (np.arange(8 * row, dtype=np.uint64) * 2654435761 % 251).astype(np.uint8).reshape(8, row)
dst = np.zeros((3, row), np.uint8)
t = NixlTransfer("tier-reader-other-host")
t.register_local([MemoryRegion(dst.ctypes.data, dst.nbytes)])
out = {}
with RpcClient(endpoint, timeout_ms=10000) as c:
    reply = c.call(Resolve([bytes([i + 1]) * 32 for i in range(3)], 10000, "reader"))
    info = reply.metadata[0]
    t.add_peer(info.agent_name, info.agent_metadata)
    rows = list(reply.ranks[0].block_ids)
    h = t.start_read(info.agent_name, np.asarray([dst.ctypes.data + i * row for i in range(3)], np.uint64),
                     np.asarray([info.pool_base + r * row for r in rows], np.uint64), np.full(3, row, np.uint64))
    deadline = time.monotonic() + 30
    while t.poll(h) == "pending" and time.monotonic() < deadline:
        time.sleep(0.001)
    out["read"] = t.poll(h)
    t.release(h)
    out["rows"] = rows
    out["exact"] = bool(np.array_equal(dst, want[rows]))
    out["released"] = c.call(Release(reply.lease_id)).released
    table = c.call(ChunkTable("reader"))
    out["table"] = [table.granted, table.reason]
t.close()
print(json.dumps(out))
"""


def _port_of(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """The port the holder prints once it serves (its other lines are logs)."""
    assert proc.stdout is not None
    out = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in out.split(b"\n")[:-1]:  # (whole lines only: a read may end inside one)
            if line.startswith(b"PORT "):
                return line.split()[1].decode()
        if select.select([proc.stdout], [], [], 0.1)[0]:
            chunk = os.read(proc.stdout.fileno(), 1 << 16)
            assert chunk, f"the holder exited ({proc.poll()}):\n{out.decode(errors='replace')[-3000:]}"
            out += chunk
    raise AssertionError(f"the holder did not serve within {timeout_s} s:\n{out.decode(errors='replace')[-3000:]}")


def test_a_reader_on_another_host_reads_over_rpc_leases_and_gets_no_chunk_table() -> None:
    remove_stale()  # namespaces a killed earlier run left behind
    with Hosts(["tier_holder", "tier_reader"], subnet="10.201.0") as hosts:
        holder, reader = hosts["tier_holder"], hosts["tier_reader"]
        env = {**os.environ, **UCX_TCP}
        proc = subprocess.Popen(holder.command([sys.executable, "-c", _HOLDER, str(ROW)]), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env)
        try:
            endpoint = f"tcp://{holder.address}:{_port_of(proc, 60)}"
            before = reader.interface_bytes()[0]
            t0 = time.monotonic()
            res = subprocess.run(reader.command([sys.executable, "-c", _READER, endpoint, str(ROW)]),
                                 capture_output=True, text=True, env=env, timeout=90)
            assert res.returncode == 0, res.stderr[-3000:]
            got = json.loads(res.stdout.strip().splitlines()[-1])
            crossed = reader.interface_bytes()[0] - before
        finally:
            if proc.poll() is None:
                proc.stdin.close()  # type: ignore[union-attr]  # (it ends on EOF)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
        print(f"across hosts: {got}, {crossed} bytes received by the reader's host in {time.monotonic() - t0:.1f} s")
        assert got["read"] == "done" and got["rows"] == [5, 1, 2] and got["exact"] and got["released"], got
        assert got["table"] == [False, "reads need the holder's progress"], got
        assert crossed >= 3 * ROW  # the rows came over the link, not through shared memory
