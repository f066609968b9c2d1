"""One ``peer_resolve`` round trip: the stream lane (plain TCP) vs ZMQ TCP, with the real handler behind each.

What a target rank pays, before its READ can start, to have its peer source
rank pin its share (docs/target.md, "Peer resolve"). Two server processes
serve the real ``peer_handlers`` (``source/peer.py``) over a real
:class:`~remote_g2.adapters.host_pool.HostPool` holding ``--hashes`` blocks:
one a :class:`~remote_g2.rpc.stream.StreamRpcServer` (``tcp+stream://``, the
source's default), one a direct ZMQ :class:`~remote_g2.rpc.server.RpcServer`
(``--peer-transport zmq``). This process calls ``peer_resolve`` then
``release`` on each, alternating, and times the resolve. Three conditions,
as a load meets them:

* ``warm``: back to back;
* ``idle``: after ``--idle-ms`` of sleep (between an engine's loads);
* ``copy``: right after a ``--copy-mib`` MiB memcpy on this CPU (a fetch's
  READ, which on one host is a CPU copy, leaves the caches cold for the next).

Processes are pinned (``--server-cpu``, ``--client-cpu``) as MPI's
``--bind-to core`` places ranks.

``--transports`` picks the servers (default ``stream,zmq``). What drawing
connection identities costs (docs/security.md, "Who owns a lease"): ``zmq``
and ``zmq-pooled`` (4 handler threads behind the Python proxy that draws
them, as rank 0's worker endpoint runs) against ``zmq-by-routing-id`` and
``zmq-pooled-by-routing-id``, the same servers keying leases by the ZMQ
routing id instead (no identities; the C proxy) — what they did before.

    python -m bench.rpc.bench_peer_lane [--rounds 200] [--hashes 64] [--idle-ms 5] [--copy-mib 64]
        [--transports stream,zmq,zmq-by-routing-id,zmq-pooled,zmq-pooled-by-routing-id] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import write_result

TRANSPORTS = ("stream", "zmq", "zmq-by-routing-id", "zmq-pooled", "zmq-pooled-by-routing-id")
#: Ratio columns printed when both are run: (measured, baseline).
RATIOS = (("stream", "zmq"), ("zmq", "zmq-by-routing-id"), ("zmq-pooled", "zmq-pooled-by-routing-id"))
CONDITIONS = ("warm", "idle", "copy")


def _hashes(n: int) -> list[bytes]:
    return [i.to_bytes(8, "big") * 4 for i in range(n)]


def _serve(transport: str, hashes: int, cpu: int | None, ready: Any, stop: Any) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    from remote_g2.adapters.host_pool import HostPool
    from remote_g2.protocol.messages import BlockLayout
    from remote_g2.rpc.server import RpcServer
    from remote_g2.rpc.stream import StreamRpcServer
    from remote_g2.source.leases import LeaseTable, PinBudget
    from remote_g2.source.peer import peer_handlers

    layout = BlockLayout(num_blocks=2 * hashes, block_bytes=4096, num_layers=1, kv=2, num_kv_heads=1,
                         tokens_per_block=16, head_dim=64, dtype_bytes=2, order="HND")
    pool = HostPool(layout)
    pool.store(_hashes(hashes), [bytes(4096)] * hashes)
    handlers = peer_handlers(LeaseTable(pool, budget=PinBudget(1 << 20)), epoch=lambda: 1,
                             lease_ttl_ms=lambda asked: asked)
    by_routing_id = transport.endswith("-by-routing-id")
    if by_routing_id:  # the baseline: leases keyed by the client-chosen routing id, no identities drawn
        handlers = {name: _keyed_by_routing_id(h) for name, h in handlers.items()}
    workers = 4 if transport.startswith("zmq-pooled") else 1
    server = (StreamRpcServer("tcp+stream://127.0.0.1:0", handlers, name="lane") if transport == "stream"
              else RpcServer("tcp://127.0.0.1:0", handlers, name="lane", workers=workers,
                             identify_clients=not by_routing_id))
    ready.put(server.start())
    stop.wait(600)  # bounded: the parent sets it when done
    server.close()


def _keyed_by_routing_id(handler: Any) -> Any:
    import dataclasses

    return lambda req, ctx: handler(req, dataclasses.replace(ctx, identity=ctx.peer))


def _cell(row: dict[str, Any], transport: str) -> str:
    return f"{row[f'{transport}_p50_ms']:.3f} ({row[f'{transport}_p90_ms']:.3f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=200, help="round trips per transport and condition")
    p.add_argument("--hashes", type=int, default=64, help="hashes per peer_resolve (64: a 64 MiB fetch in 1 MiB blocks)")
    p.add_argument("--idle-ms", type=float, default=5.0)
    p.add_argument("--copy-mib", type=int, default=64)
    p.add_argument("--server-cpu", type=int, default=0)
    p.add_argument("--client-cpu", type=int, default=0)
    p.add_argument("--transports", default="stream,zmq", help=f"comma-separated, of {', '.join(TRANSPORTS)}")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    transports = tuple(t for t in args.transports.split(",") if t)
    if not transports or set(transports) - set(TRANSPORTS):
        p.error(f"--transports: pick from {', '.join(TRANSPORTS)}")
    if not 1 <= args.rounds <= 5000 or not 1 <= args.hashes <= 4096 or not 0 < args.copy_mib <= 1024:
        p.error("need 1 <= --rounds <= 5000, 1 <= --hashes <= 4096, 0 < --copy-mib <= 1024")

    from remote_g2.protocol.messages import PeerResolve, Release
    from remote_g2.rpc.client import RpcClient

    os.sched_setaffinity(0, {args.client_cpu})
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    procs, clients = [], {}
    try:
        for transport in transports:
            ready = ctx.Queue()
            proc = ctx.Process(target=_serve, args=(transport, args.hashes, args.server_cpu, ready, stop), daemon=True)
            proc.start()
            procs.append(proc)
            clients[transport] = RpcClient(ready.get(timeout=60), timeout_ms=5000)
        src = np.ones((args.copy_mib << 20) // 8)
        dst = np.empty_like(src)
        hashes = _hashes(args.hashes)
        times: dict[tuple[str, str], list[float]] = {(c, t): [] for c in CONDITIONS for t in transports}
        lease = 1
        for transport in transports:  # connect and warm up
            clients[transport].call(PeerResolve(lease, hashes, 5000))
            clients[transport].call(Release(lease))
            lease += 1
        deadline = time.monotonic() + 600
        for condition in CONDITIONS:
            for i in range(args.rounds):
                if time.monotonic() > deadline:
                    raise SystemExit("bench_peer_lane: over 600 s; stopping")
                for transport in (transports if i % 2 == 0 else transports[::-1]):
                    client = clients[transport]
                    if condition == "idle":
                        time.sleep(args.idle_ms / 1000)
                    elif condition == "copy":
                        np.copyto(dst, src)
                    t0 = time.perf_counter()
                    reply = client.call(PeerResolve(lease, hashes, 5000))
                    times[condition, transport].append(time.perf_counter() - t0)
                    if reply.matched != args.hashes:
                        raise SystemExit(f"bench_peer_lane: {transport} pinned {reply.matched} of {args.hashes}")
                    client.call(Release(lease))
                    lease += 1
    finally:
        stop.set()
        for c in clients.values():
            c.close()
        for proc in procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()

    rows = []
    ratios = [(m, b) for m, b in RATIOS if m in transports and b in transports]
    for condition in CONDITIONS:
        row: dict[str, Any] = {"condition": condition}
        for t in transports:
            ts = sorted(times[condition, t])
            row[f"{t}_p50_ms"] = statistics.median(ts) * 1e3
            row[f"{t}_p90_ms"] = ts[int(0.9 * len(ts))] * 1e3
        for m, b in ratios:
            row[f"{m}/{b}"] = row[f"{m}_p50_ms"] / row[f"{b}_p50_ms"]
        rows.append(row)
    print(f"peer_resolve of {args.hashes} hashes + real handler, p50 (p90) ms of {args.rounds}; server CPU "
          f"{args.server_cpu}, client CPU {args.client_cpu}; {os.cpu_count()} CPUs")
    width = max(16, *(len(t) + 1 for t in transports))
    print(f"{'condition':>12} " + " ".join(f"{t:>{width}}" for t in transports)
          + "".join(f" {m + '/' + b:>{len(m) + len(b) + 2}}" for m, b in ratios))
    for r in rows:
        label = {"warm": "warm", "idle": f"{args.idle_ms:g} ms idle", "copy": f"{args.copy_mib} MiB copy"}[r["condition"]]
        cells = " ".join(f"{_cell(r, t):>{width}}" for t in transports)
        print(f"{label:>12} {cells}" + "".join(f" {r[m + '/' + b]:>{len(m) + len(b) + 2}.2f}" for m, b in ratios))
    if args.json:
        write_result(args.json, "peer_lane", args=vars(args), hashes=args.hashes, rounds=args.rounds,
                     idle_ms=args.idle_ms, copy_mib=args.copy_mib, transports=list(transports),
                     machine=platform.machine(), rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
