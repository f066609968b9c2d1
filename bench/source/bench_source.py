"""Source benchmark: resolve + release round trips against a real TP=2 source.

Everything real, on this machine: ``mpiexec -n 2`` source ranks
(``tests/source_procs/source_rank.py``: a HostPool per rank holding the
hashes, the source service with its NIXL agents, rank 0 on TCP, rank 1 on
IPC), clients in separate processes speaking the wire protocol.

Phases
  1. latency     one client, sequential: resolve(--hashes) then release, --iters
                 times after a warm-up; p50 / p99 of the round trip, and of each half.
                 Every resolve must match all hashes on both ranks.
     With --idle-ms G (default 20; 0 skips it) the same again, idling G ms
                 after each round trip: what a request costs when the source's
                 threads (and this VM's vCPUs) went idle in between.
  2. throughput  --clients processes for --seconds, each looping resolve + release
                 on the same prefix (so leases overlap and blocks are pinned many
                 times over); reports resolves/s in total.

Target (issue 4): round-trip p50 <= 2 ms for 128 hashes at TP=2.

    python -m bench.source.bench_source [--hashes 128] [--iters 2000] [--clients 4] [--seconds 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import pct, write_result
from remote_g2.protocol.messages import Release, Resolve
from remote_g2.rpc.client import RpcClient
from tests.source_procs.harness import SourceWorker, have_mpiexec
from tests.source_procs.pattern import hash_of


def one_round_trip(client: RpcClient, hashes: list[bytes], tp: int, known: list[str]) -> tuple[float, float]:
    """resolve + release; like a real target, name the agents whose metadata it already has."""
    t0 = time.perf_counter()
    reply = client.call(Resolve(hashes, 30_000, "bench", known))
    t1 = time.perf_counter()
    if not known:
        known.extend(m.agent_name for m in reply.metadata)
    if reply.reason != "ok" or reply.matched != len(hashes) or len(reply.ranks) != tp:
        raise SystemExit(f"unexpected resolve reply: {reply.reason} matched {reply.matched}")
    if not client.call(Release(reply.lease_id)).released:
        raise SystemExit(f"lease {reply.lease_id} was not released")
    return t1 - t0, time.perf_counter() - t1


def latency(endpoint: str, n_hashes: int, iters: int, tp: int, idle_s: float = 0.0) -> dict[str, Any]:
    hashes = [hash_of(i) for i in range(n_hashes)]
    known: list[str] = []
    with RpcClient(endpoint, timeout_ms=10_000) as client:
        for _ in range(min(200, iters)):
            one_round_trip(client, hashes, tp, known)
        resolve, release, total = [], [], []
        for _ in range(iters):
            if idle_s:
                time.sleep(idle_s)
            a, b = one_round_trip(client, hashes, tp, known)
            resolve.append(a)
            release.append(b)
            total.append(a + b)
    ms = 1000.0
    return {
        "iters": iters,
        "round_trip_p50_ms": pct(total, 50) * ms, "round_trip_p99_ms": pct(total, 99) * ms,
        "round_trip_mean_ms": statistics.fmean(total) * ms,
        "resolve_p50_ms": pct(resolve, 50) * ms, "resolve_p99_ms": pct(resolve, 99) * ms,
        "release_p50_ms": pct(release, 50) * ms, "release_p99_ms": pct(release, 99) * ms,
    }


def _client_loop(endpoint: str, n_hashes: int, seconds: float, tp: int, start_at: float,
                 out: mp.Queue) -> None:
    hashes = [hash_of(i) for i in range(n_hashes)]
    known: list[str] = []
    with RpcClient(endpoint, timeout_ms=10_000) as client:
        one_round_trip(client, hashes, tp, known)  # connect before the clock starts
        while time.time() < start_at:
            time.sleep(0.001)
        n = 0
        lat: list[float] = []
        end = start_at + seconds
        while time.time() < end:
            a, b = one_round_trip(client, hashes, tp, known)
            lat.append(a + b)
            n += 1
    out.put({"resolves": n, "p50_ms": pct(lat, 50) * 1000, "p99_ms": pct(lat, 99) * 1000})


def throughput(endpoint: str, n_hashes: int, clients: int, seconds: float, tp: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    start_at = time.time() + 3.0  # spawn + imports on 2 cores
    procs = [ctx.Process(target=_client_loop, args=(endpoint, n_hashes, seconds, tp, start_at, out))
             for _ in range(clients)]
    for p in procs:
        p.start()
    results = [out.get(timeout=seconds + 60) for _ in procs]
    for p in procs:
        p.join(30)
    total = sum(r["resolves"] for r in results)
    return {"clients": clients, "seconds": seconds, "resolves": total, "resolves_per_s": total / seconds,
            "per_client_p50_ms": [round(r["p50_ms"], 3) for r in results],
            "per_client_p99_ms": [round(r["p99_ms"], 3) for r in results]}


def pins_left(worker: SourceWorker, tp: int) -> list[int]:
    """Each rank's pins once the last releases landed (a rank rewrites its state every 50 ms, so the
    newest file may predate them): the first fresh state with none, else what the last one says."""
    out = []
    for r in range(tp):
        try:
            out.append(worker.wait_state(r, lambda s: s["total_pins"] == 0, timeout_s=5.0)["total_pins"])
        except AssertionError:
            out.append(worker.state(r)["total_pins"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hashes", type=int, default=128)
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--rpc-workers", type=int, default=4)
    p.add_argument("--idle-ms", type=float, default=20.0,
                   help="also measure round trips with this much idle time before each (0: skip)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if not have_mpiexec():
        raise SystemExit("mpiexec not found next to this Python (pip install mpich)")

    num_blocks = max(1024, 2 * args.hashes)
    budget = args.hashes * (args.clients + 1)
    with tempfile.TemporaryDirectory(prefix="bench-source-") as tmp:
        worker = SourceWorker(Path(tmp), f"bench-{os.getpid()}", np=args.tp,
                              args=["--hashes", str(args.hashes), "--num-blocks", str(num_blocks),
                                    "--budget", str(budget), "--rpc-workers", str(args.rpc_workers),
                                    "--lifetime-s", "900"])
        try:
            lat = latency(worker.endpoint, args.hashes, args.iters, args.tp)
            idle = (latency(worker.endpoint, args.hashes, min(args.iters, 300), args.tp, args.idle_ms / 1000)
                    if args.idle_ms > 0 else None)
            thr = throughput(worker.endpoint, args.hashes, args.clients, args.seconds, args.tp)
            leaked = pins_left(worker, args.tp)
            report = worker.stop()
        finally:
            worker.kill()

    result = {
        "tp": args.tp, "hashes": args.hashes, "rpc_workers": args.rpc_workers,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
        "latency": lat, "latency_after_idle": idle, "idle_ms": args.idle_ms, "throughput": thr,
        "pins_after": leaked, "exit": report["rc"],
        "target_p50_ms": 2.0, "meets_target": lat["round_trip_p50_ms"] <= 2.0,
    }
    rows = [
        ("resolve+release round trip p50", f"{lat['round_trip_p50_ms']:.3f} ms"),
        ("resolve+release round trip p99", f"{lat['round_trip_p99_ms']:.3f} ms"),
        ("  resolve p50 / p99", f"{lat['resolve_p50_ms']:.3f} / {lat['resolve_p99_ms']:.3f} ms"),
        ("  release p50 / p99", f"{lat['release_p50_ms']:.3f} / {lat['release_p99_ms']:.3f} ms"),
        *([(f"after {args.idle_ms:g} ms idle: resolve / release p50",
            f"{idle['resolve_p50_ms']:.3f} / {idle['release_p50_ms']:.3f} ms")] if idle else []),
        (f"resolves/s, {thr['clients']} clients", f"{thr['resolves_per_s']:.0f}"),
        ("  per-client round trip p50", ", ".join(f"{x:.2f}" for x in thr["per_client_p50_ms"]) + " ms"),
        ("pins left on each rank", str(leaked)),
        ("target p50 <= 2 ms", "met" if result["meets_target"] else "NOT met"),
    ]
    print(f"source bench: TP={args.tp}, {args.hashes} hashes per resolve, {args.iters} sequential round trips")
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v}")
    if args.json:
        write_result(args.json, "source", args=vars(args), **result)
    return 0 if result["meets_target"] and not any(leaked) else 1


if __name__ == "__main__":
    sys.exit(main())
