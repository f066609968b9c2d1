"""Lookups of a prefix much of the fleet holds: latency against the number of holders.

A system prompt or a popular document is held by most workers, so the first
blocks of a lookup can have hundreds of holders. This bench registers
``--workers`` workers (two layouts, alternating) in a real ``remote-g2
serve`` on a real Redis and in an in-process memory store (the store a
registry mirror keeps), each holding 128 blocks of 32-byte hashes, and times
lookups of a worker's chain plus 4 blocks of the request's own (which nobody
holds, as a new request's tail), in two shapes:

* ``head``: the first 8 blocks are the same for everyone, the other 120 each
  worker's own (a shared system prompt);
* ``common``: all 128 blocks are the same for everyone (a popular document).

Each with no filter, with the layout's compat key, and with a requester; and,
as the baseline in the same run, the same lookup asking for every holder
(``want_all_holders``: the walk of every candidate hash by hash that every
lookup made before the binary search, and still makes when asked for all).

    python -m bench.registry.bench_popular_prefix [--workers 100,1000] [--lookups 300] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from typing import Any, Callable

from bench import common
from bench.common import percentiles
from bench.registry.bench_registry import FP  # (the registry benches' layout)

from remote_g2.protocol.messages import BlockEvent, Events, RegisterWorker
from remote_g2.registry import RegistryClient
from remote_g2.registry.stores.memory import MemoryStore

OTHER = dataclasses.replace(FP, dtype="fp8")


def chains(workers: int, shape: str) -> dict[int, list[bytes]]:
    shared = [os.urandom(32) for _ in range(8 if shape == "head" else 128)]
    return {w: shared + [os.urandom(32) for _ in range(128 - len(shared))] for w in range(workers)}


def timed(lookup: Callable[..., Any], held: dict[int, list[bytes]], n: int, **kw: Any) -> dict[str, float]:
    samples = []
    workers = len(held)
    for i in range(n):  # the chain of an odd worker (the compat key's layout) other than w1 (the requester)
        asked = held[3 + 2 * (i % ((workers - 3) // 2))] + [os.urandom(32) for _ in range(4)]
        t = time.perf_counter()
        reply = lookup(asked, **kw)
        samples.append(time.perf_counter() - t)
        assert reply.reason == "ok" and reply.matched == 128, reply
    return percentiles(samples)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", default="100,1000")
    ap.add_argument("--lookups", type=int, default=300, help="lookups per row")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    filters = {"no filter": {}, "compat key": {"compat_key": FP.compat_key()}, "requester": {"requester": "w1"}}
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (int(w) for w in args.workers.split(",")):
            for shape in ("head", "common"):
                held = chains(workers, shape)
                memory = MemoryStore(lease_ttl_ms=10**8)
                redis_proc, url = common.start_redis(tmp)
                server, endpoint = common.start_registry("--redis-url", url, lease_ttl_s=600)
                try:
                    with RegistryClient(endpoint, timeout_s=30) as client:
                        for w, hashes in held.items():
                            fp = FP if w % 2 else OTHER
                            ep = f"tcp://127.0.0.1:{20000 + w}"
                            client.register_worker(f"w{w}", ep, fp, 1)
                            client.events(f"w{w}", 1, 1, [BlockEvent("stored", hashes)])
                            memory.register_worker(RegisterWorker(f"w{w}", ep, fp, 1))
                            memory.apply_events(Events(f"w{w}", 1, 1, [BlockEvent("stored", hashes)]))
                        for name, kw in filters.items():
                            full = {**kw, "want_all_holders": True}
                            row = {"workers": workers, "shape": shape, "filter": name,
                                   "server_redis": timed(client.lookup, held, args.lookups, **kw),
                                   "memory_store": timed(memory.lookup, held, args.lookups, **kw),
                                   "server_redis_all_holders": timed(client.lookup, held, args.lookups, **full),
                                   "memory_store_all_holders": timed(memory.lookup, held, args.lookups, **full)}
                            rows.append(row)
                            print(f"  {workers} {shape} {name}: server on Redis {row['server_redis']['p50_ms']:.2f} ms,"
                                  f" memory store {row['memory_store']['p50_ms'] * 1e3:.0f} µs", file=sys.stderr)
                finally:
                    common.stop(server)
                    common.stop(redis_proc)
    print(f"\n{'holders':>8} {'shape':<7} {'filter':<11} {'server+Redis p50 ms':>20} {'(every holder)':>15}"
          f" {'memory p50 µs':>14} {'(every holder)':>15}")
    for r in rows:
        print(f"{r['workers']:>8,} {r['shape']:<7} {r['filter']:<11} {r['server_redis']['p50_ms']:>20.2f}"
              f" {r['server_redis_all_holders']['p50_ms']:>15.2f} {r['memory_store']['p50_ms'] * 1e3:>14.0f}"
              f" {r['memory_store_all_holders']['p50_ms'] * 1e3:>15.0f}")
    if args.json:
        common.write_result(args.json, "popular_prefix", args=vars(args), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
