"""One TP rank of the transfer benchmark's source worker:
``mpiexec -n TP python -m bench.transfer.transfer_procs.source_rank ...``.

Each rank fills a :class:`~remote_g2.adapters.host_pool.HostPool` of
``--hashes`` blocks of ``--block-kib`` KiB with hashes ``hash_of(kib, 0..N-1)``
(bytes from ``rank_stream``) and starts the source service with a registry.
With ``--layout scattered`` (default) the hashes are stored in a random
order, so hash ``i`` sits in a random block and nothing coalesces (one READ
descriptor per block, what an LRU pool looks like after a while); with
``contiguous`` hash ``i`` is block ``i`` (the whole request is one descriptor
per rank).

The service's settings come from the environment like an engine's
(:meth:`SourceConfig.from_env`: ``REMOTE_G2_SOURCE_BIND``,
``REMOTE_G2_SOURCE_ADVERTISE``, TTLs, ...), with the bench's own settings on
top: enabled, ``--registry``, ``--ipc-dir``, the layout's fingerprint, a pin
budget with room for 8 loads in flight, ``--peer-transport``.

The raw baseline (see ``target_rank.py``) reads the same pool memory through
a second, bare NIXL agent per rank (``RawAgent``; its metadata in
``DIR/raw-agent-{rank}.bin``). Over UCX TCP a READ is emulated in software
and only completes while the source drives its agent, so that agent is
driven every ``--raw-progress-us`` (0: as fast as the loop goes) while the
target's driver holds ``DIR/raw-progress`` open (a window around each raw
measurement, acknowledged in ``DIR/raw-progress-ack-{rank}``), and every
20 ms otherwise (enough for a connection's wire-up), so it takes no CPU from
the end-to-end requests measured in between. ``--raw-progress-us -1``: never
faster than 20 ms (loopback, where UCX ``cma`` copies without the source).

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
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench.transfer.transfer_procs.common import (
    fingerprint_for,
    hash_of,
    make_layout,
    rank_stream,
    raw_agent_name,
    write_json,
)

from remote_g2.adapters.host_pool import HostPool
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.source import SourceConfig, maybe_start_source_service

IDLE_PROGRESS_S = 0.02
FLAG_CHECK_S = 0.001  # while driving fast, how often the window's flag file is looked at


class RawAgent:
    """A bare NIXL agent on this rank's pool memory, for the raw baseline; driven by a thread of its own.

    Nothing of the source service is shared with it but the memory: the
    target's raw agent reads the same addresses (the client's descriptors)
    from this agent instead of the service's. Its thread is the only one
    touching the agent after start-up (NIXL's default sync mode is not
    thread-safe); ``close`` stops it before the agent goes.
    """

    def __init__(self, name: str, regions: list[MemoryRegion], d: Path, rank: int, fast_interval_s: float) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        from remote_g2.ucx_modules import keep_one_verbs_stack

        keep_one_verbs_stack()
        self.name, self._d, self._rank, self._fast = name, d, rank, fast_interval_s
        self._agent: Any = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False,
                                                              backends=["UCX"]))
        self._regs = [self._agent.register_memory([(r.base, r.nbytes, r.device_id, "")], r.mem_type)
                      for r in regions]
        path = d / f"raw-agent-{rank}.bin"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(self._agent.get_agent_metadata())
        os.replace(tmp, path)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"{name}-progress", daemon=True)
        self._thread.start()

    def _window(self) -> str | None:
        """The open window's sequence number (``DIR/raw-progress``), or None."""
        try:
            return (self._d / "raw-progress").read_text().strip() or None
        except OSError:
            return None

    def _ack(self, text: str) -> None:
        write_json(self._d / f"raw-progress-ack-{self._rank}", text)

    def _run(self) -> None:
        acked = None
        while not self._stop.is_set():
            seq = self._window() if self._fast >= 0 else None
            if seq is None:
                if acked is not None:
                    self._ack(f"off {acked}")
                    acked = None
                self._agent.get_new_notifs()  # drives the UCX worker (wire-up of a new reader)
                self._stop.wait(IDLE_PROGRESS_S)
                continue
            if seq != acked:
                self._ack(f"on {seq}")
                acked = seq
            until = time.monotonic() + FLAG_CHECK_S
            while time.monotonic() < until:  # drive the agent as a hand-written NIXL source would
                self._agent.get_new_notifs()
                if self._fast > 0:
                    time.sleep(self._fast)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        for reg in self._regs:
            try:
                self._agent.deregister_memory(reg)
            except Exception as e:
                print(f"raw agent {self.name}: deregistering failed: {e}", file=sys.stderr)
        self._regs.clear()
        self._agent = None


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
    p.add_argument("--raw-progress-us", type=float, default=-1.0,
                   help="how often the raw baseline's agent is driven during a raw window (0: continuously; "
                        "-1: only every 20 ms, no windows)")
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

    # What the bench needs whatever the environment says; everything else (bind, advertise, TTLs, progress
    # pacing, ...) from REMOTE_G2_SOURCE_* like an engine's source. Also passed as from_env's defaults so that
    # its validation (a registry needs a fingerprint) sees them.
    required: dict[str, Any] = dict(enabled=True, registry_endpoint=args.registry, ipc_dir=args.ipc_dir,
                                    # room for 8 loads in flight plus releases still on their way
                                    pin_budget_blocks=args.hashes * 16,
                                    fingerprint=fingerprint_for(layout, tp), peer_transport=args.peer_transport)
    config = SourceConfig.from_env(max_lease_ttl_ms=60_000, **required).with_overrides(**required)
    service = maybe_start_source_service(pool, worker_id=args.worker_id, config=config, comm=comm)
    assert service is not None and service.rank == rank and service.tp_size == tp
    raw = RawAgent(raw_agent_name(args.worker_id, rank), pool.regions(), d, rank, args.raw_progress_us / 1e6)
    if rank == 0:
        write_json(d / "endpoint.json", {"endpoint": service.endpoint, "epoch": service.epoch, "pid": os.getpid(),
                                         "bind": config.bind, "advertise": config.advertise,
                                         "advertised": getattr(service, "advertised_endpoint", None)})
    deadline = time.monotonic() + args.lifetime_s
    state = d / f"state-{rank}.json"
    try:
        while not (d / "stop").exists() and time.monotonic() < deadline:
            st = pool.stats()
            write_json(state, {"pid": os.getpid(), "rank": rank, "total_pins": st["total_pins"],
                               "service": service.stats(), "t": time.time()})
            time.sleep(0.2)
    finally:
        raw.close()
        service.shutdown()
        write_json(d / f"done-{rank}", {"total_pins": pool.stats()["total_pins"], "service": service.stats()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
