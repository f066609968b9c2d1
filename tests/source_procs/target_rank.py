"""One TP rank of a synthetic target worker: look up, load over real NIXL, check every destination byte.

Run every rank with ``mpiexec -n TP python tests/source_procs/target_rank.py --dir D --registry E ...``.
The target's layout matches the synthetic source's (``pattern.make_layout``)
with ``--total-heads / TP`` kv heads per rank. Rank 0 (the leader) looks up
``hash_of(0..N-1)``, starts one load into destination blocks ``--dst-start``
onwards and waits on the client's finished fd (``wait_finished``), taking
``get_finished`` after each wake-up, until the request finishes or
``--wait-s`` passes, then writes ``D/leader.json`` (with whether the fd was
readable just before the outcome was taken and just after); every rank then compares
each loaded destination block with what the source ranks hold
(:func:`expected_block`, using the TP mapping's head slices) and writes
``D/verify-{rank}.json``. Ranks > 0 wait for ``leader.json`` on the file
system, never in MPI (MPICH spins a core while it waits).

Every rank writes ``D/pid-{rank}`` first (so a test can freeze or kill it).
The leader's ``leader.json`` also holds ``log``: every WARNING the target
client logged on that rank (a failed load names its reason there); each
``verify-{rank}.json`` holds the rank's own ``log`` and ``dst_written`` (the
destination blocks with any non-zero byte).

Options for the failure tests:

* ``--mla``: both sides are MLA (``is_mla``, one latent kv head per rank,
  replicated: every source rank holds ``block_bytes_for(0, hash)``; the source
  runs ``source_rank.py --mla``);
* ``--hash-offset K``: ask for ``hash_of(K..K+N-1)`` (no one holds K >= 32);
* ``--force-load``: call ``start_load`` with every hash even when the lookup
  matched nothing (the client then fails the request itself);
* ``--lease-ttl-ms`` / ``--rpc-timeout-ms``: the TargetConfig fields;
* ``--delay-read-s S``: fault injection for this test script only. The
  transfer adapter becomes :class:`DelayedNixlTransfer` (registered here as
  ``nixl-delayed-read``): the real NIXL adapter, except that each
  ``start_read`` first writes ``D/reading-{rank}`` and sleeps ``S`` seconds —
  a stand-in for a slow fabric, which opens a window between resolve and READ
  in which a test can kill the source or freeze the leader;
* ``--late-read-s S``: READs are posted at once but report done only ``S``
  seconds later (``fault_procs.slow_transfer.LateNixlTransfer``): a slow
  fabric as the client sees it, with nothing blocked — its loops keep
  turning (renewals, other loads) meanwhile;
* ``--second-miss``: once rank 0's READ post for ``req-1`` has begun (with
  ``--delay-read-s``: ``D/reading-0`` exists) the leader also
  ``start_load``s ``req-miss`` for hashes no source holds (``hash_of(1000..)``),
  which the client fails after one registry lookup, and records when that
  failure showed in ``get_finished`` (``miss_failed_after_s``) and whether
  ``req-1`` was still loading then (``req1_open_at_miss``);
* ``--rank-gone R``: rank ``R`` (> 0) shuts its client down right after
  start-up and writes ``D/gone-{R}``; the leader waits for that file before
  it looks up (a rank whose client stopped: the leader must fail the load at
  once, not wait for a report that cannot come);
* ``--warm-load``: before ``req-1``, load the same hashes into the same
  blocks once (``req-warm``: every rank then holds the source's metadata, so
  ``req-1`` may resolve each share with its peer rank), then every rank zeroes
  them again; ``--wait-go``: after that, the leader waits for ``D/go``
  (so a test can inject a fault first); ``--peer-resolve 0|1``: the
  TargetConfig field;
* ``--linger-s S``: once the outcome is known, every rank records which
  destination blocks hold bytes (``dst_written_at_outcome``), waits ``S``
  seconds with its client still up, and only then verifies (so a READ that
  lands after the engine heard the outcome shows in ``dst_written``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from source_procs.files import write_whole  # noqa: E402
from source_procs.pattern import block_bytes_for, hash_of, make_layout  # noqa: E402

from remote_g2.adapters.nixl_transfer import NixlTransfer  # noqa: E402
from remote_g2.plugins import register_adapter  # noqa: E402
from remote_g2.memory.secondary_pool import MemoryRegion  # noqa: E402
from remote_g2.protocol.messages import BlockLayout, LayoutFingerprint  # noqa: E402
from remote_g2.target import TargetConfig, start_target_client  # noqa: E402
from remote_g2.target.metrics import PHASES  # noqa: E402
from remote_g2.target.tp_mapping import head_slices  # noqa: E402


class DestPool:
    """The target rank's destination memory: a zeroed buffer of ``num_blocks`` blocks."""

    def __init__(self, layout: BlockLayout) -> None:
        self._layout = layout
        self.buf = np.zeros(layout.num_blocks * layout.block_bytes, dtype=np.uint8)

    @property
    def layout(self) -> BlockLayout:
        return self._layout

    def regions(self) -> list[MemoryRegion]:
        return [MemoryRegion(self.buf.ctypes.data, self.buf.nbytes)]

    def block(self, b: int) -> np.ndarray:
        bb = self._layout.block_bytes
        return self.buf[b * bb:(b + 1) * bb]


class DelayedNixlTransfer(NixlTransfer):
    """The ``nixl`` adapter with a sleep before every READ is posted (``--delay-read-s``; see the module doc)."""

    delay_s = 0.0
    marker: Path | None = None

    def start_read(self, agent_name, local_addr, remote_addr, nbytes, **kw):  # type: ignore[override]
        marker = type(self).marker
        if marker is not None and not marker.exists():
            write_whole(marker, str(time.time()))
        time.sleep(type(self).delay_s)
        return super().start_read(agent_name, local_addr, remote_addr, nbytes, **kw)


class LogLines(logging.Handler):
    """Keeps the formatted WARNING+ records of the target client (the failure reasons)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.lines.append(record.getMessage()[:2000])
        except Exception:  # pragma: no cover
            pass


def expected_block(block_hash: bytes, *, rank: int, tp: int, source_tp: int, total_heads: int, is_mla: bool,
                   mla_offset: int) -> np.ndarray:
    """What target rank ``rank``'s copy of the block must hold, built from the source ranks' patterns."""
    if is_mla:  # every source rank holds rank 0's bytes, one latent head, whole blocks on both sides
        return block_bytes_for(0, block_hash, make_layout(num_kv_heads=1).block_bytes)
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


def zero_blocks(pool: DestPool, blocks: list[int]) -> None:
    for b in blocks:
        pool.block(b)[...] = 0


def warm_load(client: Any, hashes: list[bytes], dst: list[int], d: Path, tp: int, pool: DestPool,
              wait_s: float) -> dict:
    """``--warm-load``: load ``hashes`` into ``dst`` once (every rank gets the source's metadata), then have
    every rank zero ``dst`` again, so the load the test checks starts from zeros; what the first load did."""
    client.start_load("req-warm", hashes, dst)
    t0 = time.monotonic()
    done: set[str] = set()
    failed: set[str] = set()
    while "req-warm" not in done | failed and time.monotonic() - t0 < wait_s:
        client.wait_finished(0.05)
        a, b = client.get_finished()
        done |= a
        failed |= b
    client.invalid_block_ids()
    peer_loads = client.stats["peer_loads"]
    zero_blocks(pool, dst)
    write_whole(d / "warm-done", json.dumps(dst))
    while not all((d / f"zeroed-{r}").exists() for r in range(1, tp)) and time.monotonic() - t0 < wait_s:
        time.sleep(0.005)
    return {"done": sorted(done), "failed": sorted(failed), "peer_loads": peer_loads}


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
    p.add_argument("--hash-offset", type=int, default=0)
    p.add_argument("--force-load", action="store_true")
    p.add_argument("--lease-ttl-ms", type=int, default=10_000)
    p.add_argument("--rpc-timeout-ms", type=int, default=2000)
    p.add_argument("--delay-read-s", type=float, default=0.0)
    p.add_argument("--late-read-s", type=float, default=0.0)
    p.add_argument("--linger-s", type=float, default=0.0)
    p.add_argument("--rank-gone", type=int, default=0)
    p.add_argument("--registry-mirror", action="store_true")
    p.add_argument("--second-miss", action="store_true")
    p.add_argument("--warm-load", action="store_true")
    p.add_argument("--peer-resolve", type=int, default=1)
    p.add_argument("--gather", type=int, default=1, help="ask sources to stage small pieces (TargetConfig.gather)")
    p.add_argument("--wait-go", action="store_true")
    args = p.parse_args()

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, tp = comm.Get_rank(), comm.Get_size()
    d = args.dir
    write_whole(d / f"pid-{rank}", str(os.getpid()))
    logs = LogLines()
    logging.getLogger("remote_g2.target").addHandler(logs)
    heads_per_rank = 1 if args.mla else args.total_heads // tp
    layout = make_layout(num_blocks=64, num_kv_heads=heads_per_rank)
    pool = DestPool(layout)
    fp = LayoutFingerprint(model_id="synthetic", dtype="bf16", tokens_per_block=layout.tokens_per_block,
                           kv_layout="HND", num_layers=layout.num_layers,
                           num_kv_heads=1 if args.mla else args.total_heads,
                           head_dim=layout.head_dim, tp_size=tp, is_mla=args.mla)
    transfer = "nixl"
    if args.delay_read_s > 0:
        DelayedNixlTransfer.delay_s = args.delay_read_s
        DelayedNixlTransfer.marker = d / f"reading-{rank}"
        register_adapter("transfer", "nixl-delayed-read", __name__, "DelayedNixlTransfer")
        transfer = "nixl-delayed-read"
    elif args.late_read_s > 0:
        os.environ["REMOTE_G2_TEST_DONE_DELAY_S"] = str(args.late_read_s)
        register_adapter("transfer", "nixl-late-read", "fault_procs.slow_transfer", "LateNixlTransfer")
        transfer = "nixl-late-read"
    config = TargetConfig(enabled=True, registry_endpoint=args.registry, transfer=transfer, ipc_dir=args.ipc_dir,
                          transfer_timeout_ms=args.timeout_ms, rpc_timeout_ms=args.rpc_timeout_ms,
                          lease_ttl_ms=args.lease_ttl_ms, fingerprint=fp, registry_mirror=args.registry_mirror,
                          peer_resolve=bool(args.peer_resolve), gather=bool(args.gather))
    client = start_target_client(pool, worker_id="target-w", config=config, comm=comm)
    hashes = [hash_of(args.hash_offset + i) for i in range(args.hashes)]
    if args.rank_gone and rank == args.rank_gone:
        client.shutdown()
        (d / f"gone-{rank}").write_text("ok")
    try:
        if rank == 0:
            out: dict = {}
            try:
                while args.rank_gone and not (d / f"gone-{args.rank_gone}").exists():
                    time.sleep(0.01)
                if args.registry_mirror and not client.wait_registry_mirror(10):
                    raise RuntimeError("the registry mirror took no snapshot in 10 s")
                t_start = time.monotonic()
                m = client.lookup(hashes)
                out["match"] = {"matched": m.matched, "reason": m.reason, "worker_id": m.worker_id}
                n = len(hashes) if args.force_load and not m.matched else m.matched
                dst = list(range(args.dst_start, args.dst_start + n))
                out["dst"] = dst
                if n and args.warm_load:
                    out["warm"] = warm_load(client, hashes[:n], dst, d, tp, pool, args.wait_s)
                    while args.wait_go and not (d / "go").exists() and time.monotonic() - t_start < args.wait_s:
                        time.sleep(0.005)
                t0 = time.monotonic()
                if n:
                    client.start_load("req-1", hashes[:n], dst)
                    if args.second_miss:  # once rank 0's own READ post has begun
                        while not (d / "reading-0").exists() and time.monotonic() - t0 < args.wait_s:
                            time.sleep(0.001)
                        out["miss_started_after_s"] = time.monotonic() - t0
                        client.start_load("req-miss", [hash_of(1000 + i) for i in range(n)],
                                          list(range(args.dst_start + n, args.dst_start + 2 * n)))
                    done: set[str] = set()
                    failed: set[str] = set()
                    invalid: set[int] = set()
                    while "req-1" not in done | failed and time.monotonic() - t0 < args.wait_s:
                        # Sleep on the client's finished fd, as an engine with an event loop would.
                        ready = client.wait_finished(min(0.05, max(0.0, args.wait_s - (time.monotonic() - t0))))
                        if not ready:
                            # An event loop reads only when woken. (Reading anyway raced: an outcome posted
                            # between the wait's timeout and this read looked like a wake-up that never came.)
                            continue
                        a, b = client.get_finished()
                        if "req-1" in a | b:
                            out["fd_ready_before_outcome"] = ready
                        if "req-miss" in b:
                            out["miss_failed_after_s"] = time.monotonic() - t0
                            out["req1_open_at_miss"] = "req-1" not in done | failed | a
                            b = b - {"req-miss"}
                            invalid |= client.invalid_block_ids() - set(range(args.dst_start + n,
                                                                              args.dst_start + 2 * n))
                        done |= a
                        failed |= b
                        invalid |= client.invalid_block_ids()
                    out["fd_ready_after_outcome"] = client.wait_finished(0)
                    reg = client.metrics.registry
                    out.update(done=sorted(done), failed=sorted(failed), invalid=sorted(invalid),
                               seconds=time.monotonic() - t0, stats=client.stats,
                               phases={p: [reg.get_sample_value("remote_g2_target_load_phase_seconds_count",
                                                                {"phase": p}) or 0,
                                           reg.get_sample_value("remote_g2_target_load_phase_seconds_sum",
                                                                {"phase": p}) or 0]
                                       for p in PHASES})
            except Exception:
                out["error"] = traceback.format_exc()
            out["log"] = list(logs.lines)
            write_whole(d / "leader.json", json.dumps(out))
        else:
            deadline = time.monotonic() + args.wait_s + 30
            zeroed = not args.warm_load
            while not (d / "leader.json").exists() and time.monotonic() < deadline:
                if not zeroed and (d / "warm-done").exists():
                    zero_blocks(pool, json.loads((d / "warm-done").read_text()))
                    write_whole(d / f"zeroed-{rank}", "ok")
                    zeroed = True
                time.sleep(0.01)
        leader = json.loads((d / "leader.json").read_text())
        at_outcome = [b for b in leader.get("dst", []) if pool.block(b).any()]
        if args.linger_s > 0:
            time.sleep(args.linger_s)
        mismatches, checked = [], 0
        invalid = set(leader.get("invalid", []))
        if leader.get("done"):
            import zlib
            mla_offset = zlib.crc32(b"target-w") % args.source_tp  # what the client uses
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
        dst_written = [b for b in leader.get("dst", []) if pool.block(b).any()]
        shares_done, shares_failed = client.get_finished_shares()  # how this rank's own shares ended
        (d / f"verify-{rank}.json").write_text(json.dumps({"checked": checked, "mismatches": mismatches,
                                                           "shares_done": sorted(shares_done),
                                                           "shares_failed": sorted(shares_failed),
                                                           "share_invalid": sorted(client.share_invalid_block_ids()),
                                                           "untouched_written": untouched,
                                                           "dst_written": dst_written,
                                                           "dst_written_at_outcome": at_outcome,
                                                           "bounced_reads": client.stats["bounced_reads"],
                                                           "log": list(logs.lines)}))
    finally:
        client.shutdown()
        (d / f"done-{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
