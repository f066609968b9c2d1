#!/usr/bin/env python3
"""Benchmark: find_and_pin + unpin of long prefixes on a large pool index.

One op = pin the blocks of a ``--prefix``-hash prefix (all present) and unpin
them again, on an index of ``--blocks`` blocks with 8-byte hashes. Three
implementations, measured in the same run on the same requests:

- ``pure-python``: ``tests/pool_index_reference.py`` (dict + OrderedDict +
  threading.Lock), list in, list out;
- ``cpp-list``: ``PoolIndex.find_and_pin(list_of_bytes)`` +
  ``unpin_blocks_by_id(list)``;
- ``cpp-batch``: ``find_and_pin_packed(buffer)`` → numpy int32 →
  ``unpin_packed(array)``.

With ``--threads 1,2`` each row is run by 1 and by 2 threads sharing one
index (ops/s is the total over threads). Prints a table; ``--json PATH``
writes every number. Example::

    python -m bench.memory.bench_pool_index --blocks 1048576 --prefix 128 --seconds 2 --threads 1,2
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from bench.common import write_result
from remote_g2.memory.pool_index import PoolIndex
from tests.pool_index_reference import ReferencePoolIndex  # (the test suite's model of the index)

NUM_REQUESTS = 512  # distinct prefixes cycled through, so caches do not flatter


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=1 << 20, help="pool size (default 1048576)")
    p.add_argument("--prefix", type=int, default=128, help="hashes per request (default 128)")
    p.add_argument("--seconds", type=float, default=2.0,
                   help="time per row (default 2.0); ignored with --iters")
    p.add_argument("--iters", type=int, default=None, help="ops per thread per row instead of --seconds")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    args.threads = [int(t) for t in args.threads.split(",")]
    if args.blocks < args.prefix or args.prefix < 1 or min(args.threads) < 1:
        p.error("need 1 <= prefix <= blocks and thread counts >= 1")
    if args.iters is not None and args.iters < 1:
        p.error("--iters must be >= 1")
    return args


def make_op(name: str, index, requests: list[tuple[list[bytes], bytes]]) -> Callable[[int], int]:
    """The timed operation for one implementation: op(i) runs request i, returns hits."""
    if name == "cpp-batch":
        def op(i: int) -> int:
            ids = index.find_and_pin_packed(requests[i][1], 8)
            index.unpin_packed(ids)
            return len(ids)
    else:  # pure-python and cpp-list share the list API
        def op(i: int) -> int:
            ids = index.find_and_pin(requests[i][0])
            index.unpin_blocks_by_id(ids)
            return len(ids)
    return op


def run_row(op: Callable[[int], int], threads: int, seconds: float, iters: int | None,
            prefix: int) -> dict:
    """Run `op` from `threads` threads at once; ops/s over the wall time, and
    the latency of every op."""
    latencies: list[list[int]] = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads + 1)
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        lat = latencies[t]
        clock = time.perf_counter_ns
        i = t * 7919
        try:
            barrier.wait()
            deadline = clock() + int(seconds * 1e9)
            while True:
                t0 = clock()
                hits = op(i % NUM_REQUESTS)
                t1 = clock()
                lat.append(t1 - t0)
                if hits != prefix:
                    raise AssertionError(f"expected {prefix} hits, got {hits}")
                i += 1
                if (len(lat) >= iters) if iters is not None else (t1 >= deadline):
                    break
        except BaseException as e:  # reported below
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    barrier.wait()
    start = time.perf_counter()
    for th in pool:
        th.join()
    wall = time.perf_counter() - start
    if errors:
        raise errors[0]
    all_lat = np.concatenate([np.asarray(x, dtype=np.int64) for x in latencies])
    return {
        "ops": int(all_lat.size),
        "wall_s": wall,
        "ops_per_s": all_lat.size / wall,
        "p50_us": float(np.percentile(all_lat, 50)) / 1e3,
        "p99_us": float(np.percentile(all_lat, 99)) / 1e3,
        "mean_us": float(all_lat.mean()) / 1e3,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rng = np.random.default_rng(args.seed)

    # Random 8-byte hashes (the TensorRT-LLM/Dynamo u64, big-endian); block i holds hash i.
    values = np.unique(rng.integers(0, 2**63, size=args.blocks + args.blocks // 16 + 16,
                                    dtype=np.uint64))
    values = rng.permutation(values)[: args.blocks]
    assert values.size == args.blocks, "not enough distinct hashes drawn"
    packed = values.astype(">u8").tobytes()
    block_ids = np.arange(args.blocks, dtype=np.int32)

    t0 = time.perf_counter()
    cpp = PoolIndex(args.blocks)
    cpp.insert_packed(packed, block_ids, 8)
    fill_cpp = time.perf_counter() - t0
    t0 = time.perf_counter()
    ref = ReferencePoolIndex(args.blocks)
    ref.insert_packed(packed, block_ids, 8)
    fill_ref = time.perf_counter() - t0

    starts = rng.integers(0, args.blocks - args.prefix + 1, size=NUM_REQUESTS)
    requests = []
    for s in starts.tolist():
        buf = packed[8 * s: 8 * (s + args.prefix)]
        requests.append(([buf[8 * k: 8 * k + 8] for k in range(args.prefix)], buf))

    # Everything built so far lives for the whole run: keep the GC from
    # rescanning it during the timed loops (same for every implementation).
    gc.collect()
    gc.freeze()

    impls = [("pure-python", ref), ("cpp-list", cpp), ("cpp-batch", cpp)]
    rows = []
    for threads in args.threads:
        base = None
        for name, index in impls:
            op = make_op(name, index, requests)
            op(0)  # warm up (and check the prefix hits) outside the timing
            r = run_row(op, threads, args.seconds, args.iters, args.prefix)
            if name == "pure-python":
                base = r["ops_per_s"]
            r.update(impl=name, threads=threads, speedup=r["ops_per_s"] / base)
            rows.append(r)
            assert index.stats()["total_pins"] == 0

    print(f"pool index: find_and_pin + unpin of {args.prefix}-hash prefixes, "
          f"{args.blocks:,} blocks, 8-byte hashes")
    print(f"fill ({args.blocks:,} inserts): C++ insert_packed {fill_cpp:.2f} s, "
          f"pure Python {fill_ref:.2f} s")
    header = f"{'threads':>7}  {'implementation':<14} {'ops/s':>10} {'p50 µs':>9} {'p99 µs':>9} {'vs pure':>8}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['threads']:>7}  {r['impl']:<14} {r['ops_per_s']:>10,.0f} {r['p50_us']:>9.1f} "
              f"{r['p99_us']:>9.1f} {r['speedup']:>7.1f}x")

    if args.json:
        write_result(
            args.json, "pool_index.find_and_pin_unpin",
            config= {"blocks": args.blocks, "prefix": args.prefix, "seconds": args.seconds,
                       "iters": args.iters, "threads": args.threads, "seed": args.seed,
                       "hash_len": 8, "distinct_requests": NUM_REQUESTS},
            machine={"python": sys.version.split()[0], "numpy": np.__version__,
                     "platform": platform.platform(), "cpus": os.cpu_count()},
            fill_seconds={"cpp_insert_packed": fill_cpp, "pure_python_insert_packed": fill_ref},
            rows=rows,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
