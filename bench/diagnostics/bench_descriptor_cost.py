"""Descriptor-cost benchmark: one 64 MiB NIXL READ issued as N descriptors, N in (16, 256, 4096, 16384).

Everything real, on this machine: a source peer process
(``tests/source_procs/nixl_source_peer.py``: its own NIXL agent, UCX, a
registered buffer of known bytes) and this process reading from it with
:class:`remote_g2.adapters.nixl_transfer.NixlTransfer` (UCX picks ``cma``
for the bytes and TCP on loopback for the wire-up; nothing else is bound).

For each N the same ``--mib`` are read as N equal extents (64 MiB / 16 =
4 MiB extents ... / 16384 = 4 KiB), in two layouts:

* ``contiguous`` — extent i of the destination reads extent i of the source
  (what a fully coalesced run looks like before coalescing: NIXL may merge);
* ``scattered``  — the source extents are a random permutation (blocks spread
  over the pool; nothing can be merged);
* ``scattered destination`` — the source extents lie back to back (a part
  the source staged) and the destination extents are a random permutation
  (a target whose blocks take each source rank's heads in pieces, TP 2 → 1);
  beside it ``land + scatter``: the same bytes READ as one descriptor into a
  landing buffer, then copied to the scattered destination extents in this
  process (:func:`remote_g2.memory.extent_copy.copy_extents`, GIL released) — what
  a target-side bounce buffer would cost, to tell whether it pays.

Each cell is the median of ``--reps`` timed READs (after one warm-up READ
whose bytes are checked): ``start`` = ``start_read`` (descriptor lists,
request creation, post), ``total`` = until ``poll`` says done. A numpy copy
of the same bytes in this process is the baseline.

    python -m bench.diagnostics.bench_descriptor_cost [--mib 64] [--reps 5] [--counts 16,256,4096,16384] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result
from remote_g2.memory.extent_copy import copy_extents
from remote_g2.memory.secondary_pool import MemoryRegion
from tests.source_procs.nixl_source_peer import PeerProcess, pattern_bytes

SEED = 3
READ_TIMEOUT_S = 30.0


def timed_read(t: Any, peer: str, local: np.ndarray, remote: np.ndarray, nbytes: np.ndarray) -> tuple[float, float]:
    """(start_read seconds, total seconds) of one READ polled to completion."""
    t0 = time.perf_counter()
    h = t.start_read(peer, local, remote, nbytes)
    t1 = time.perf_counter()
    try:
        while (state := t.poll(h)) == "pending":
            if time.perf_counter() - t0 > READ_TIMEOUT_S:
                raise SystemExit(f"READ of {len(nbytes)} descriptors did not finish in {READ_TIMEOUT_S} s")
        t2 = time.perf_counter()
    finally:
        t.release(h)
    if state != "done":
        raise SystemExit(f"READ of {len(nbytes)} descriptors ended in {state}")
    return t1 - t0, t2 - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mib", type=int, default=64, help="bytes per READ, MiB (at most 1024)")
    p.add_argument("--reps", type=int, default=5, help="timed READs per cell (median reported; at most 50)")
    p.add_argument("--counts", default="16,256,4096,16384", help="descriptor counts, comma-separated")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    total = args.mib << 20
    if not 0 < args.mib <= 1024 or not 0 < args.reps <= 50 or any(c <= 0 or total % c for c in counts):
        p.error("need 0 < mib <= 1024, 0 < reps <= 50, and counts dividing the byte count")

    from remote_g2.adapters.nixl_transfer import NixlTransfer

    src_copy = pattern_bytes(SEED, total)  # what the peer holds: the baseline's source and the check
    dst = np.zeros(total, dtype=np.uint8)
    landing = np.zeros(total, dtype=np.uint8)  # the land + scatter rows' bounce buffer
    base_s = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        np.copyto(dst, src_copy)
        base_s.append(time.perf_counter() - t0)

    rng = np.random.default_rng(0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="rg2-bench-") as tmp:
        peer = PeerProcess(Path(tmp), f"bench-peer-{os.getpid()}", total, seed=SEED)
        t = NixlTransfer(f"bench-target-{os.getpid()}")
        try:
            t.register_local([MemoryRegion(dst.ctypes.data, dst.nbytes),
                              MemoryRegion(landing.ctypes.data, landing.nbytes)])
            t.add_peer(peer.name, peer.metadata)
            landing_at = np.array([landing.ctypes.data], dtype=np.uint64)
            remote_one = np.array([peer.info["base"]], dtype=np.uint64)
            whole = np.array([total], dtype=np.uint64)
            for n in counts:
                size = total // n
                for layout in ("contiguous", "scattered", "scattered destination", "land + scatter"):
                    order = np.arange(n, dtype=np.uint64) if layout == "contiguous" else \
                        rng.permutation(n).astype(np.uint64)
                    local = dst.ctypes.data + np.arange(n, dtype=np.uint64) * np.uint64(size)
                    remote = np.uint64(peer.info["base"]) + order * np.uint64(size)
                    if layout != "scattered":  # the source's extents back to back; the destination's in `order`
                        local, remote = (dst.ctypes.data + order * np.uint64(size),
                                         np.uint64(peer.info["base"]) + np.arange(n, dtype=np.uint64) * np.uint64(size))
                    nbytes = np.full(n, size, dtype=np.uint64)
                    if layout == "land + scatter":
                        def run(local: np.ndarray = local, nbytes: np.ndarray = nbytes) -> tuple[float, float]:
                            t0 = time.perf_counter()
                            start, _ = timed_read(t, peer.name, landing_at, remote_one, whole)
                            copy_extents(local, landing_at + np.arange(n, dtype=np.uint64) * np.uint64(size), nbytes)
                            return start, time.perf_counter() - t0
                    else:
                        def run(local: np.ndarray = local, remote: np.ndarray = remote,
                                nbytes: np.ndarray = nbytes) -> tuple[float, float]:
                            return timed_read(t, peer.name, local, remote, nbytes)
                    dst[:] = 0
                    run()  # warm-up, checked
                    if layout in ("contiguous", "scattered"):
                        want = src_copy.reshape(n, size)[order.astype(np.int64)].ravel()
                    else:
                        want = np.empty_like(src_copy)
                        want.reshape(n, size)[order.astype(np.int64)] = src_copy.reshape(n, size)
                    if not np.array_equal(dst, want):
                        raise SystemExit(f"N={n} {layout}: bytes differ from the source")
                    runs = [run() for _ in range(args.reps)]
                    start_s = statistics.median(r[0] for r in runs)
                    total_s = statistics.median(r[1] for r in runs)
                    rows.append({"descriptors": n, "bytes_per_descriptor": size, "layout": layout,
                                 "start_s": start_s, "total_s": total_s, "gb_per_s": total / total_s / 1e9,
                                 "us_per_descriptor": total_s / n * 1e6, "runs_s": [r[1] for r in runs]})
        finally:
            t.close()
            peer.stop()

    base = statistics.median(base_s)
    print(f"{args.mib} MiB per READ, median of {args.reps}; NIXL {_nixl_version()} UCX, "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    print(f"{'descriptors':>11} {'bytes/desc':>10} {'layout':>22} {'start s':>9} {'total s':>9} "
          f"{'GB/s':>7} {'us/desc':>8}")
    for r in rows:
        print(f"{r['descriptors']:>11} {r['bytes_per_descriptor']:>10} {r['layout']:>22} {r['start_s']:>9.5f} "
              f"{r['total_s']:>9.5f} {r['gb_per_s']:>7.2f} {r['us_per_descriptor']:>8.2f}")
    print(f"{'memcpy':>11} {total:>10} {'numpy':>22} {'':>9} {base:>9.5f} {total / base / 1e9:>7.2f} {'':>8}")
    if args.json:
        write_result(args.json, "descriptor_cost", args=vars(args), mib=args.mib, reps=args.reps,
                     nixl=_nixl_version(), rows=rows,
                     memcpy={"total_s": base, "gb_per_s": total / base / 1e9, "runs_s": base_s})
    return 0


def _nixl_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "?"


if __name__ == "__main__":
    sys.exit(main())
