"""One TP rank of the transfer benchmark's source worker (``mpiexec -n TP python source_rank.py ...``).

Each rank fills a :class:`~remote_g2.adapters.host_pool.HostPool` of
``--hashes`` blocks of ``--block-kib`` KiB with hashes ``hash_of(kib, 0..N-1)``
(bytes from ``rank_stream``) and starts the source service with a registry.
With ``--layout scattered`` (default) the hashes are stored in a random
order, so hash ``i`` sits in a random block and nothing coalesces (one READ
descriptor per block, what an LRU pool looks like after a while); with
``contiguous`` hash ``i`` is block ``i`` (the whole request is one descriptor
per rank).

Rank 0 writes ``DIR/endpoint.json``; every rank rewrites ``DIR/state-{rank}.json``
(pid, total pins, service stats) every 200 ms until ``DIR/stop`` appears or
``--lifetime-s`` passes, never waiting in MPI after start-up. On the way out
each rank shuts the service down and then writes ``DIR/done-{rank}``.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
from transfer_procs.common import fingerprint_for, hash_of, make_layout, rank_stream, write_json  # noqa: E402

from remote_g2.adapters.host_pool import HostPool  # noqa: E402
from remote_g2.source import SourceConfig, maybe_start_source_service  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--block-kib", type=int, required=True)
    p.add_argument("--hashes", type=int, required=True)
    p.add_argument("--layout", choices=("scattered", "contiguous"), default="scattered")
    p.add_argument("--pool-pages", choices=("huge", "4k"), default="huge",
                   help="the pool in 2 MiB transparent huge pages (HostPool's default) or 4 KiB pages")
    p.add_argument("--registry", required=True)
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--lifetime-s", type=float, default=300.0)
    p.add_argument("--peer-transport", choices=("stream", "zmq"), default="stream")
    args = p.parse_args()
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s [pid {os.getpid()}] %(name)s: %(message)s")

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, tp = comm.Get_rank(), comm.Get_size()
    d: Path = args.dir
    layout = make_layout(args.block_kib, args.hashes)
    bb = layout.block_bytes
    stream = rank_stream(rank, args.block_kib, args.hashes * bb)
    order = (np.random.default_rng([7, args.block_kib]).permutation(args.hashes) if args.layout == "scattered"
             else np.arange(args.hashes)).tolist()
    pool = HostPool(layout, huge_pages=args.pool_pages == "huge")
    ids = pool.store([hash_of(args.block_kib, i) for i in order], [stream[i * bb:(i + 1) * bb] for i in order])
    if ids != list(range(args.hashes)):  # the bench's descriptor counts assume it
        raise SystemExit(f"rank {rank}: the pool placed the blocks at {ids[:8]}..., not 0..N-1 in call order")
    del stream

    config = SourceConfig(enabled=True, registry_endpoint=args.registry, ipc_dir=args.ipc_dir,
                          # room for 8 loads in flight plus releases still on their way
                          pin_budget_blocks=args.hashes * 16, max_lease_ttl_ms=60_000,
                          fingerprint=fingerprint_for(layout, tp), peer_transport=args.peer_transport)
    service = maybe_start_source_service(pool, worker_id=args.worker_id, config=config, comm=comm)
    assert service is not None and service.rank == rank and service.tp_size == tp
    if rank == 0:
        write_json(d / "endpoint.json", {"endpoint": service.endpoint, "epoch": service.epoch, "pid": os.getpid()})
    deadline = time.monotonic() + args.lifetime_s
    state = d / f"state-{rank}.json"
    try:
        while not (d / "stop").exists() and time.monotonic() < deadline:
            st = pool.stats()
            write_json(state, {"pid": os.getpid(), "rank": rank, "total_pins": st["total_pins"],
                               "service": service.stats(), "t": time.time()})
            time.sleep(0.2)
    finally:
        service.shutdown()
        write_json(d / f"done-{rank}", {"total_pins": pool.stats()["total_pins"], "service": service.stats()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
