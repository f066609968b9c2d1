"""One TP rank of the gather benchmark's source worker:
``mpiexec -n S python -m bench.transfer.gather_procs.source_rank ...``.

Fills a HostPool (huge pages) of ``--blocks`` blocks of the model's layout at
TP S with hashes ``hash_of(tag, 0..N-1)`` stored in a random order, so hash
``i`` sits in a random block (what an LRU pool looks like after a while:
nothing coalesces), starts the source service with a registry, and keeps a
bare NIXL agent on the same pool memory for the raw baselines (the transfer
bench's ``RawAgent``). Writes ``DIR/info-{rank}.json`` (pool base and size,
layout, the block id of every hash, the bare agent's name; its metadata in
``DIR/raw-agent-{rank}.bin``) and ``DIR/endpoint.json`` (rank 0), then
rewrites ``DIR/state-{rank}.json`` (pins, service stats) every 200 ms until
``DIR/stop`` appears.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench.transfer.gather_procs.layouts import block_stream, fingerprint_for, hash_of, layout_dict, layout_for
from bench.transfer.transfer_procs.common import raw_agent_name, write_json
from bench.transfer.transfer_procs.source_rank import RawAgent

from remote_g2.adapters.host_pool import HostPool
from remote_g2.source import SourceConfig, maybe_start_source_service


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--spec", required=True, help="the model's layout, JSON (see bench_gather.py)")
    p.add_argument("--tag", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--registry", required=True)
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--staging-mib", type=int, default=256)
    p.add_argument("--lifetime-s", type=float, default=600.0)
    args = p.parse_args()
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s [pid {os.getpid()}] %(name)s: %(message)s")

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, tp = comm.Get_rank(), comm.Get_size()
    d: Path = args.dir
    spec = json.loads(args.spec)
    n = args.blocks
    layout = layout_for(spec, tp, n)
    bb = layout.block_bytes
    stream = block_stream(rank, args.tag, n * bb)
    order = np.random.default_rng([7, args.tag]).permutation(n).tolist()
    pool = HostPool(layout, huge_pages=True)
    ids = pool.store([hash_of(args.tag, i) for i in order], [stream[i * bb:(i + 1) * bb] for i in order])
    block_of = [0] * n
    for i, b in zip(order, ids):
        block_of[i] = b
    del stream
    required: dict[str, Any] = dict(enabled=True, registry_endpoint=args.registry, ipc_dir=args.ipc_dir,
                                    pin_budget_blocks=n * 16, fingerprint=fingerprint_for(spec, tp),
                                    staging_mib=args.staging_mib)
    config = SourceConfig.from_env(max_lease_ttl_ms=60_000, **required).with_overrides(**required)
    service = maybe_start_source_service(pool, worker_id=args.worker_id, config=config, comm=comm)
    assert service is not None and service.rank == rank and service.tp_size == tp
    raw = RawAgent(raw_agent_name(args.worker_id, rank), pool.regions(), d, rank, -1.0)
    region = pool.regions()[0]
    write_json(d / f"info-{rank}.json", {"pool_base": region.base, "pool_bytes": region.nbytes,
                                         "layout": layout_dict(layout), "block_of": block_of,
                                         "raw_agent": raw.name})
    if rank == 0:
        write_json(d / "endpoint.json", {"endpoint": service.endpoint, "epoch": service.epoch, "pid": os.getpid()})
    deadline = time.monotonic() + args.lifetime_s
    state = d / f"state-{rank}.json"
    try:
        while not (d / "stop").exists() and time.monotonic() < deadline:
            m = service.metrics
            write_json(state, {"pid": os.getpid(), "rank": rank, "total_pins": pool.stats()["total_pins"],
                               "service": service.stats(), "t": time.time(),
                               "resolve_s": [m.value("remote_g2_source_resolve_seconds_count"),
                                             m.value("remote_g2_source_resolve_seconds_sum")],
                               "gather_s": [m.value("remote_g2_source_gather_seconds_count"),
                                            m.value("remote_g2_source_gather_seconds_sum")]})
            time.sleep(0.2)
    finally:
        raw.close()
        service.shutdown()
        write_json(d / f"done-{rank}", {"total_pins": pool.stats()["total_pins"], "service": service.stats()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
