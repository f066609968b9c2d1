"""One TP rank of a synthetic target worker: look up, load over real NIXL, check every destination byte.

Run every rank with ``mpiexec -n TP python tests/source_procs/target_rank.py --dir D --registry E ...``.
The target's layout matches the synthetic source's (``pattern.make_layout``)
with ``--total-heads / TP`` kv heads per rank. Rank 0 (the leader) looks up
``hash_of(0..N-1)``, starts one load into destination blocks ``--dst-start``
onwards and polls ``get_finished`` until the request finishes or
``--wait-s`` passes, then writes ``D/leader.json``; every rank then compares
each loaded destination block with what the source ranks hold
(:func:`expected_block`, using the TP mapping's head slices) and writes
``D/verify-{rank}.json``. Ranks > 0 wait for ``leader.json`` on the file
system, never in MPI (MPICH spins a core while it waits).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from source_procs.pattern import block_bytes_for, hash_of, make_layout  # noqa: E402

from remote_g2.adapters.secondary_pool import MemoryRegion  # noqa: E402
from remote_g2.messages import BlockLayout, LayoutFingerprint  # noqa: E402
from remote_g2.target import TargetConfig, start_target_client  # noqa: E402
from remote_g2.target.tp_mapping import head_slices  # noqa: E402


class DestPool:
    """The target rank's destination memory: a zeroed buffer of ``num_blocks`` blocks."""

    def __init__(self, layout: BlockLayout) -> None:
        self._layout = layout
        self.buf = np.zeros(layout.num_blocks * layout.block_bytes, dtype=np.uint8)

    def layout(self) -> BlockLayout:
        return self._layout

    def regions(self) -> list[MemoryRegion]:
        return [MemoryRegion(self.buf.ctypes.data, self.buf.nbytes)]

    def block(self, b: int) -> np.ndarray:
        bb = self._layout.block_bytes
        return self.buf[b * bb:(b + 1) * bb]


def expected_block(block_hash: bytes, *, rank: int, tp: int, source_tp: int, total_heads: int, is_mla: bool,
                   mla_offset: int) -> np.ndarray:
    """What target rank ``rank``'s copy of the block must hold, built from the source ranks' patterns."""
    src = make_layout(num_kv_heads=total_heads // source_tp)
    dst = make_layout(num_kv_heads=total_heads // tp)
    out = np.zeros(dst.block_bytes, dtype=np.uint8)
    head_bytes = src.tokens_per_block * src.head_dim * src.dtype_bytes
    for s in head_slices(rank, source_tp=source_tp, target_tp=tp, source_heads=src.num_kv_heads,
                         target_heads=dst.num_kv_heads, is_mla=is_mla, mla_offset=mla_offset):
        data = block_bytes_for(s.source_rank, block_hash, src.block_bytes)
        n = (s.source_hi - s.source_lo) * head_bytes
        for slab in range(src.num_layers * src.kv):
            a = slab * src.slab_bytes + s.source_lo * head_bytes
            b = slab * dst.slab_bytes + s.target_lo * head_bytes
            out[b:b + n] = data[a:a + n]
    return out


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--registry", required=True)
    p.add_argument("--hashes", type=int, default=16)
    p.add_argument("--source-tp", type=int, default=2)
    p.add_argument("--total-heads", type=int, default=4)
    p.add_argument("--mla", action="store_true")
    p.add_argument("--dst-start", type=int, default=5)
    p.add_argument("--timeout-ms", type=int, default=5000)
    p.add_argument("--wait-s", type=float, default=30.0)
    p.add_argument("--ipc-dir", required=True)
    args = p.parse_args()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, tp = comm.Get_rank(), comm.Get_size()
    d = args.dir
    layout = make_layout(num_blocks=64, num_kv_heads=args.total_heads // tp)
    pool = DestPool(layout)
    fp = LayoutFingerprint(model_id="synthetic", dtype="bf16", tokens_per_block=layout.tokens_per_block,
                           kv_layout="HND", num_layers=layout.num_layers, num_kv_heads=args.total_heads,
                           head_dim=layout.head_dim, tp_size=tp, is_mla=args.mla)
    config = TargetConfig(enabled=True, registry_endpoint=args.registry, transfer="nixl", ipc_dir=args.ipc_dir,
                          transfer_timeout_ms=args.timeout_ms, rpc_timeout_ms=2000, fingerprint=fp)
    client = start_target_client(pool, worker_id="target-w", config=config, comm=comm)
    hashes = [hash_of(i) for i in range(args.hashes)]
    try:
        if rank == 0:
            out: dict = {}
            try:
                m = client.lookup(hashes)
                out["match"] = {"matched": m.matched, "reason": m.reason, "worker_id": m.worker_id}
                dst = list(range(args.dst_start, args.dst_start + m.matched))
                out["dst"] = dst
                t0 = time.monotonic()
                if m.matched:
                    client.start_load("req-1", hashes[:m.matched], dst)
                    done: set[str] = set()
                    failed: set[str] = set()
                    invalid: set[int] = set()
                    while not (done or failed) and time.monotonic() - t0 < args.wait_s:
                        a, b = client.get_finished()
                        done |= a
                        failed |= b
                        invalid |= client.invalid_block_ids()
                        time.sleep(0.001)
                    out.update(done=sorted(done), failed=sorted(failed), invalid=sorted(invalid),
                               seconds=time.monotonic() - t0, stats=client.stats)
            except Exception:
                out["error"] = traceback.format_exc()
            (d / "leader.json").write_text(json.dumps(out))
        else:
            deadline = time.monotonic() + args.wait_s + 30
            while not (d / "leader.json").exists() and time.monotonic() < deadline:
                time.sleep(0.01)
        leader = json.loads((d / "leader.json").read_text())
        mismatches, checked = [], 0
        invalid = set(leader.get("invalid", []))
        if leader.get("done"):
            import zlib
            mla_offset = zlib.crc32(b"target-w") % args.source_tp
            for i, b in enumerate(leader["dst"]):
                if b in invalid:
                    continue
                want = expected_block(hashes[i], rank=rank, tp=tp, source_tp=args.source_tp,
                                      total_heads=args.total_heads, is_mla=args.mla, mla_offset=mla_offset)
                checked += 1
                if not np.array_equal(pool.block(b), want):
                    mismatches.append(b)
        untouched = [b for b in range(layout.num_blocks) if b not in leader.get("dst", [])
                     and pool.block(b).any()]
        (d / f"verify-{rank}.json").write_text(json.dumps({"checked": checked, "mismatches": mismatches,
                                                           "untouched_written": untouched}))
    finally:
        client.shutdown()
        (d / f"done-{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
