"""A remote reader of a synthetic source: resolve, NIXL READ every rank's blocks, check the bytes, release.

``python tests/source_procs/nixl_reader.py --endpoint E --hashes N --out R.json [--loops L] [--no-release]``

Each loop resolves ``hash_of(start .. start+N-1)``, loads every source rank's
agent metadata once (from the resolve reply; later resolves list the agents
as known), READs each rank's matched blocks into its own local buffer with a
real NIXL transfer (its own agent, listen and progress threads off, polling
with a timeout) and compares them byte for byte with
``pattern.block_bytes_for(rank, hash)``. The result (every reply, mismatches,
latencies) is written to ``R.json`` *before* NIXL is torn down, so a crash at
interpreter exit cannot hide it; ``RESULT ok``/``RESULT fail`` goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from source_procs.pattern import block_bytes_for, hash_of  # noqa: E402

from remote_g2.protocol.messages import Release, Resolve  # noqa: E402
from remote_g2.rpc.client import RpcClient  # noqa: E402


class Reader:
    """One NIXL agent reading from every rank of one source."""

    def __init__(self, max_blocks: int) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from remote_g2.ucx_modules import keep_one_verbs_stack

        keep_one_verbs_stack()
        self.agent = nixl_agent(f"test-reader-{os.getpid()}", nixl_agent_config(
            enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"]))
        self.max_blocks = max_blocks
        self.peers: dict[int, dict] = {}  # rank -> {"name", "remote", "local", "buf", "reg", "layout"}

    def ensure_peer(self, info) -> None:
        if info.rank in self.peers:
            return
        if info.agent_metadata is None:
            raise RuntimeError(f"rank {info.rank}: no agent metadata and not loaded yet")
        bb = info.layout.block_bytes
        name = self.agent.add_remote_agent(info.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        remote = self.agent.prep_xfer_dlist(
            name, [(info.pool_base + b * bb, bb, 0) for b in range(info.layout.num_blocks)], "DRAM")
        buf = np.zeros(self.max_blocks * bb, dtype=np.uint8)
        base = buf.ctypes.data
        reg = self.agent.register_memory([(base, buf.nbytes, 0, "")], "DRAM")
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", [(base + i * bb, bb, 0) for i in range(self.max_blocks)],
                                           "DRAM")
        self.peers[info.rank] = {"name": name, "remote": remote, "local": local, "buf": buf, "reg": reg,
                                 "layout": info.layout}

    def read(self, ranks, timeout_s: float = 10.0) -> None:
        handles = []
        for rb in ranks:
            if not rb.block_ids:
                continue
            peer = self.peers[rb.rank]
            h = self.agent.make_prepped_xfer("READ", peer["local"], list(range(len(rb.block_ids))), peer["remote"],
                                             list(rb.block_ids), b"")
            state = self.agent.transfer(h)
            if state == "ERR":
                raise RuntimeError(f"rank {rb.rank}: transfer could not start")
            handles.append((rb.rank, h))
        deadline = time.monotonic() + timeout_s
        try:
            pending = list(handles)
            while pending:
                still = []
                for rank, h in pending:
                    state = self.agent.check_xfer_state(h)
                    if state == "ERR":
                        raise RuntimeError(f"rank {rank}: transfer failed")
                    if state != "DONE":
                        still.append((rank, h))
                pending = still
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(f"READ did not finish within {timeout_s} s (ranks {[r for r, _ in pending]})")
        finally:
            for _, h in handles:
                self.agent.release_xfer_handle(h)

    def close(self) -> None:
        for peer in self.peers.values():
            self.agent.release_dlist_handle(peer["local"])
            self.agent.release_dlist_handle(peer["remote"])
            self.agent.deregister_memory(peer["reg"])
            self.agent.remove_remote_agent(peer["name"])
        self.peers.clear()
        del self.agent


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--endpoint", required=True)
    p.add_argument("--hashes", type=int, required=True)
    p.add_argument("--start", type=int, default=0)
    p.add_argument("--loops", type=int, default=1)
    p.add_argument("--ttl-ms", type=int, default=30_000)
    p.add_argument("--no-release", action="store_true")
    p.add_argument("--out", required=True, type=Path)
    args = p.parse_args()

    hashes = [hash_of(args.start + i) for i in range(args.hashes)]
    client = RpcClient(args.endpoint, timeout_ms=10_000)
    reader = Reader(args.hashes)
    result: dict = {"ok": False, "replies": [], "mismatches": [], "resolve_s": [], "read_s": [], "release_s": []}
    try:
        for _ in range(args.loops):
            t0 = time.perf_counter()
            reply = client.call(Resolve(hashes, args.ttl_ms, "test-reader",
                                        [p["name"] for p in reader.peers.values()]))
            t1 = time.perf_counter()
            result["replies"].append({"reason": reply.reason, "lease_id": reply.lease_id, "matched": reply.matched,
                                      "epoch": reply.epoch, "expires_in_ms": reply.expires_in_ms,
                                      "ranks": {rb.rank: list(rb.block_ids) for rb in reply.ranks},
                                      "metadata_sent": [m.rank for m in reply.metadata if m.agent_metadata]})
            if reply.reason != "ok":
                continue
            for info in reply.metadata:
                reader.ensure_peer(info)
            reader.read(reply.ranks)
            t2 = time.perf_counter()
            for rb in reply.ranks:
                peer = reader.peers[rb.rank]
                bb = peer["layout"].block_bytes
                for i in range(reply.matched):
                    got = peer["buf"][i * bb:(i + 1) * bb]
                    if not np.array_equal(got, block_bytes_for(rb.rank, hashes[i], bb)):
                        result["mismatches"].append({"rank": rb.rank, "index": i, "block": rb.block_ids[i]})
            if not args.no_release:
                t3 = time.perf_counter()
                released = client.call(Release(reply.lease_id)).released
                result["release_s"].append(time.perf_counter() - t3)
                result["replies"][-1]["released"] = released
            result["resolve_s"].append(t1 - t0)
            result["read_s"].append(t2 - t1)
        result["ok"] = not result["mismatches"]
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    args.out.write_text(json.dumps(result))
    print("RESULT", "ok" if result["ok"] else "fail", flush=True)
    sys.stdout.flush()
    client.close()
    reader.close()
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
