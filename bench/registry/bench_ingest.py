"""Registry ingest, end to end from publishers: block events/s one registry server applies.

``--publishers`` real :class:`~remote_g2.registry.SourcePublisher` instances
(each its own worker id and connection), spread over ``--procs`` processes,
play engines whose G2 pools turn over: each stores chunks of
``--chunk`` fresh 32-byte hashes and, once it holds ``--pool`` of them,
removes its oldest chunk for every chunk it stores. A producer keeps each
publisher's backlog under two batches (an engine that outruns its
publisher would have its backlog dropped for a resync, which this bench
counts and reports). One ``remote-g2 serve`` takes the events on each store
in ``--stores`` (``memory``: the embedded store; ``redis``; ``cluster``: a
3-master Redis Cluster), fresh for each.

Measured: the server's own ``events_ingested`` counter over ``--seconds``
after a one-second warm-up (stored plus removed hashes applied), so the
rate is what the registry took, not what publishers queued. Afterwards the
publishers flush and the bench checks that the registry holds exactly the
hashes the pools hold (the workers' block counts sum to what the pools
hold) and reports how many resyncs publishers needed: nothing lost.

    python -m bench.registry.bench_ingest [--stores memory,redis,cluster] [--json bench/results/ingest.json]

Everything binds 127.0.0.1; every loop is bounded by ``--seconds``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from bench import common
from bench.registry.bench_registry import FP  # (the registry benches' layout)
from tests.conftest import start_redis_cluster  # (the test suite's cluster builder)

from remote_g2.registry import RegistryClient, SourcePublisher


def _play(endpoint: str, first: int, count: int, args: dict[str, Any], go: Any, stop: Any, out: Any) -> None:
    """One process: ``count`` publishers, fed round-robin until ``stop`` is set; then flush and report."""
    pubs, pools, locks = [], [], []

    def snapshot(pool: deque[list[bytes]], lock: threading.Lock) -> list[bytes]:
        with lock:  # the pool as it is between two producer steps
            return [h for c in pool for h in c]

    for i in range(first, first + count):
        pool: deque[list[bytes]] = deque()
        lock = threading.Lock()
        pools.append(pool)
        locks.append(lock)
        client = RegistryClient(endpoint, timeout_s=30)
        pubs.append(SourcePublisher(client, worker_id=f"ingest-{i}", endpoint=f"tcp://127.0.0.1:{30000 + i}",
                                    fingerprint=FP, snapshot=lambda p=pool, k=lock: snapshot(p, k),
                                    max_batch_hashes=args["batch"], flush_interval_s=0.01).start())
    for p in pubs:
        if not p.flush(30):
            raise RuntimeError(f"publisher {p.worker_id} did not register")
    go.wait(60)
    chunk, keep, limit = args["chunk"], args["pool"] // args["chunk"], 2 * args["batch"]
    seed = os.urandom(8)
    n = 0
    deadline = time.monotonic() + args["seconds"] + 30  # bounded even if the parent never says stop
    while not stop.is_set() and time.monotonic() < deadline:
        busy = False
        for p, pool, lock in zip(pubs, pools, locks):
            if p.backlog_hashes >= limit:
                continue
            busy = True
            hashes = [seed + (n + k).to_bytes(24, "big") for k in range(chunk)]
            n += chunk
            with lock:  # the pool and the queue change together, as an engine's pool and its events would
                pool.append(hashes)
                p.stored(hashes)
                if len(pool) > keep:
                    p.removed(pool.popleft())
        if not busy:
            time.sleep(0.0005)
    flushed = all(p.flush(60) for p in pubs)
    out.put({"held": sum(len(c) for pool in pools for c in pool), "flushed": flushed,
             "resyncs": sum(p.resyncs - 1 for p in pubs),  # the first resync is registration's
             "batches": sum(p.batches_sent for p in pubs)})
    for p in pubs:
        p.close()


def run_store(store: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    procs: list[Any] = []
    try:
        store_args: list[str] = []
        if store == "redis":
            proc, url = common.start_redis(tmp)
            procs.append(proc)
            store_args = ["--redis-url", url]
        elif store == "cluster":
            cluster_procs, url = start_redis_cluster(Path(tmp) / f"cluster-{time.monotonic_ns()}")
            procs.extend(cluster_procs)
            store_args = ["--redis-cluster-url", url]
        server, endpoint = common.start_registry(*store_args, lease_ttl_s=60, log_path=args.server_log)
        procs.append(server)
        ctx = mp.get_context("spawn")
        go, stop, out = ctx.Event(), ctx.Event(), ctx.Queue()
        per = [args.publishers // args.procs + (i < args.publishers % args.procs) for i in range(args.procs)]
        settings = {"chunk": args.chunk, "pool": args.pool, "batch": args.batch, "seconds": args.seconds}
        players = [ctx.Process(target=_play, args=(endpoint, sum(per[:i]), per[i], settings, go, stop, out))
                   for i in range(args.procs)]
        for p in players:
            p.start()
        with RegistryClient(endpoint, timeout_s=30) as admin:
            deadline = time.monotonic() + 60
            while admin.stats().workers_live < args.publishers:
                if time.monotonic() > deadline:
                    raise RuntimeError("publishers did not all register")
                time.sleep(0.1)
            go.set()
            time.sleep(1.0)  # warm-up: the pools fill, the batches reach their size
            s0, t0 = admin.stats().events_ingested, time.perf_counter()
            time.sleep(args.seconds)
            s1, t1 = admin.stats().events_ingested, time.perf_counter()
            stop.set()
            reports = [out.get(timeout=120) for _ in players]
            for p in players:
                p.join(30)
            # What each worker's current incarnation holds (block_entries also counts a superseded
            # incarnation's blocks until the sweeper has dropped them).
            entries = sum(w.blocks for w in admin.list_workers() if w.worker_id.startswith("ingest-"))
        held = sum(r["held"] for r in reports)
        row = {"store": store, "publishers": args.publishers, "procs": args.procs,
               "events_per_s": (s1 - s0) / (t1 - t0), "events": s1 - s0, "seconds": t1 - t0,
               "batches": sum(r["batches"] for r in reports), "resyncs": sum(r["resyncs"] for r in reports),
               "flushed": all(r["flushed"] for r in reports), "registry_entries": entries, "pools_hold": held,
               "nothing_lost": entries == held and all(r["flushed"] for r in reports)}
        print(f"  {store}: {row['events_per_s']:,.0f} block events/s; registry holds {entries:,}, "
              f"pools hold {held:,}; resyncs {row['resyncs']}", file=sys.stderr)
        return row
    finally:
        for p in reversed(procs):
            common.stop(p)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stores", default="memory,redis,cluster")
    ap.add_argument("--publishers", type=int, default=8, help="SourcePublisher instances (workers), in all")
    ap.add_argument("--procs", type=int, default=2, help="processes the publishers run in")
    ap.add_argument("--chunk", type=int, default=256, help="hashes an engine stores (or evicts) at once")
    ap.add_argument("--pool", type=int, default=200_000, help="hashes each worker's pool holds before it evicts")
    ap.add_argument("--batch", type=int, default=8192, help="the publishers' max_batch_hashes")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured window per store")
    ap.add_argument("--server-log", default=None, help="append the registry servers' stderr here")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for store in args.stores.split(","):
            rows.append(run_store(store, args, tmp))
    print(f"\n{'store':<8} {'block events/s':>15} {'batches':>8} {'resyncs':>8} {'nothing lost':>13}")
    for r in rows:
        print(f"{r['store']:<8} {r['events_per_s']:>15,.0f} {r['batches']:>8} {r['resyncs']:>8} "
              f"{'yes' if r['nothing_lost'] else 'NO':>13}")
    if args.json:
        common.write_result(args.json, "ingest", args=vars(args), rows=rows)
    return 0 if all(r["nothing_lost"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
