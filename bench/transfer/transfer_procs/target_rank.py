"""One TP rank of the transfer benchmark's target worker:
``mpiexec -n TP python -m bench.transfer.transfer_procs.target_rank ...``.

Every rank starts a target client (transfer adapter: the real NIXL one with
timestamps, :class:`~transfer_procs.common.RecordingNixl`) over a destination
pool of ``--hashes`` blocks, plus a second, bare NIXL agent of its own for the
raw baseline, registered on the same destination memory.

Rank 0 drives the run and the other ranks follow commands it writes as files
(``DIR/cmd-{seq}.json``; each rank answers ``DIR/ack-{seq}-{rank}.json``):
nobody waits in MPI after start-up. Commands: ``zero`` / ``check`` the first
``n`` destination blocks (byte-exact against ``rank_stream``; a wrong byte
aborts), ``raw`` (re-issue, with the bare agent, exactly the descriptors the
client's READ of that many bytes used, starting at the shared instant ``t0``,
from the source rank's own bare agent on the same memory — see
``source_rank.py``; ``--raw-window``: rank 0 opens a progress window on the
source around every raw measurement, so that the source drives that agent
as fast as a hand-written NIXL source would, which UCX TCP needs for every READ),
``memcpy`` (numpy copy of the same bytes at ``t0``), ``raw_stream`` (``count``
raw READs, ``depth`` in flight at most), ``stop``.

Rank 0's sequence: the first contact (a 1-block request, the first this
target makes: metadata fetch and connection to a source it never talked to;
checked), then a warm-up request (checked), a raw warm-up (zeroed, then
checked) and memcpy; then ``--reps`` rounds of {e2e request, raw READ, memcpy}
with the order alternating (the last e2e request zeroed first and checked);
then the same for 1-block requests. Each e2e request is
``lookup -> start_load -> get_finished`` polled every ``--poll-us`` into the
same destination blocks ``0..n-1`` (reused by every request).

Then, with ``--stream-requests K`` (0: skipped), the sustained rate:
``--stream-rounds`` rounds, order alternating, of {``K`` full-size requests
with up to ``--stream-depth D`` in flight (request ``i`` lands in destination
copy ``i % D``; the pool holds ``D`` copies), the same ``K`` raw READs with up
to ``D`` posted at once}; every copy is zeroed before the last stream round
and checked after it.

Results (``DIR/result.json``, rank 0) and every rank's timestamps
(``DIR/events-{rank}.json``) are written before NIXL is torn down; then
``DIR/done-{rank}``.

The code, by part: ``target_commands`` (a rank's pool, the commands every
rank runs, how ranks > 0 follow them), ``target_driver`` (rank 0's
sequence); this module: the arguments, the client's set-up and its
timestamps, and writing the results.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench.transfer.transfer_procs import common
from bench.transfer.transfer_procs.common import EVENTS, fingerprint_for, make_layout, record, write_json
from bench.transfer.transfer_procs.target_commands import Abort, DestPool, Rank, follow
from bench.transfer.transfer_procs.target_driver import Driver

from remote_g2.adapters.nixl_transfer import NixlTransfer
from remote_g2.target import TargetConfig, start_target_client
from remote_g2.target.tp_mapping import ReadPlanner


def instrument_rpc() -> None:
    """Timestamp every RPC this process makes (lookup, resolve, release) and every message on its local links.

    Blocking calls (``RpcClient.call``) from send to return; calls through the
    leader's event loop (``RpcMux.call``) from send to the moment their
    callback runs.
    """
    from remote_g2.rpc.client import RpcClient
    from remote_g2.rpc.mux import RpcMux

    orig = RpcClient.call

    def call(self: Any, request: Any, **kw: Any) -> Any:  # RpcClient.call's keywords, whatever they are
        t0 = time.monotonic()
        try:
            return orig(self, request, **kw)
        finally:
            record("rpc:" + type(request).__name__, t0, time.monotonic())

    RpcClient.call = call  # type: ignore[method-assign]
    orig_mux = RpcMux.call

    def mux_call(self: Any, endpoint: str, request: Any, callback: Any, **kw: Any) -> None:
        t0 = time.monotonic()

        def timed(outcome: Any) -> None:
            record("rpc:" + type(request).__name__, t0, time.monotonic())
            callback(outcome)

        orig_mux(self, endpoint, request, timed, **kw)

    RpcMux.call = mux_call  # type: ignore[method-assign]

    from remote_g2.rpc.local_link import MessageLink

    orig_send, orig_receive = MessageLink.send, MessageLink.receive

    def send(self: Any, message: Any) -> None:
        t0 = time.monotonic()
        orig_send(self, message)
        record("link_send:" + type(message).__name__, t0, time.monotonic())

    def receive(self: Any) -> list[Any]:
        t0 = time.monotonic()
        out = orig_receive(self)
        t1 = time.monotonic()
        for message in out:
            record("link_recv:" + type(message).__name__, t0, t1)
        return out

    MessageLink.send, MessageLink.receive = send, receive  # type: ignore[method-assign]


def instrument_client(client: Any) -> None:
    """Timestamp the client's internal steps by wrapping instance attributes (nothing in target/ changes)."""
    worker = client._worker
    start = worker.start

    def timed_start(load: Any, received: float) -> None:
        record("submit", time.monotonic(), None, load.load_id)
        start(load, received)

    worker.start = timed_start
    plan = ReadPlanner.plan

    def timed_plan(self: Any, *args: Any) -> Any:  # class-wide: the worker makes its planners itself
        t0 = time.monotonic()
        try:
            return plan(self, *args)
        finally:
            record("plan", t0, time.monotonic())

    ReadPlanner.plan = timed_plan  # type: ignore[method-assign]
    if client.rank != 0:
        return
    coordinator = client.coordinator
    for name in ("_begin", "_complete"):
        orig = getattr(coordinator, name)

        def wrapped(*a: Any, _orig: Any = orig, _name: str = name) -> Any:
            t0 = time.monotonic()
            try:
                return _orig(*a)
            finally:
                record(_name.lstrip("_"), t0, time.monotonic())

        setattr(coordinator, name, wrapped)
    rank_done = coordinator.rank_done

    def timed_rank_done(done: Any) -> None:
        record("rank_done", time.monotonic(), None, [done.rank, done.load_id, done.ok])
        rank_done(done)

    coordinator.rank_done = timed_rank_done  # rank 0's own share reaches it through the coordinator's events too


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--registry", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--block-kib", type=int, required=True)
    p.add_argument("--hashes", type=int, required=True)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--poll-us", type=float, default=0.0,
                   help="get_finished polling interval of the bench loop (0: block in wait_finished instead)")
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--lifetime-s", type=float, default=240.0)
    p.add_argument("--registry-mirror", action="store_true", help="look up in an in-process registry mirror")
    p.add_argument("--peer-resolve", choices=("on", "off"), default="on", help="TargetConfig.peer_resolve")
    p.add_argument("--stream-requests", type=int, default=0, help="requests per stream round (0: no streams)")
    p.add_argument("--stream-depth", type=int, default=2, help="requests in flight at most in a stream")
    p.add_argument("--stream-rounds", type=int, default=3, help="stream rounds (each: an e2e and a raw stream)")
    p.add_argument("--stream-poll-us", type=float, default=1000.0, help="get_finished polling interval in streams")
    p.add_argument("--source-dir", required=True, type=Path,
                   help="the source worker's --dir: its bare agents' metadata, the raw windows' flag and acks")
    p.add_argument("--source-worker-id", required=True, help="the source worker's id (its bare agents' names)")
    p.add_argument("--raw-window", action="store_true",
                   help="open a progress window on the source around every raw measurement (UCX TCP)")
    args = p.parse_args()
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s [pid {os.getpid()}] %(name)s: %(message)s")

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, tp = comm.Get_rank(), comm.Get_size()
    d: Path = args.dir
    deadline = time.monotonic() + args.lifetime_s
    layout = make_layout(args.block_kib, args.hashes)
    # room for a stream's destination copies; the fingerprint does not depend on the pool's size
    pool = DestPool(make_layout(args.block_kib, args.hashes * max(1, args.stream_depth)))
    instrument_rpc()
    config = TargetConfig(enabled=True, registry_endpoint=args.registry,
                          transfer="bench.transfer.transfer_procs.common:RecordingNixl",
                          ipc_dir=args.ipc_dir, transfer_timeout_ms=20_000, rpc_timeout_ms=5_000,
                          fingerprint=fingerprint_for(layout, tp), registry_mirror=args.registry_mirror,
                          peer_resolve=args.peer_resolve == "on",
                          # The raw baseline re-issues the client's own descriptors, which a staged part
                          # (in the source's staging region) does not have: pieces read in place only.
                          # Gathered reads are bench_gather.py's (at this bench's 64 KiB and 1 MiB blocks the
                          # source's rule reads in place anyway).
                          gather=False)
    client = start_target_client(pool, worker_id=args.worker_id, config=config, comm=comm)
    instrument_client(client)
    raw = NixlTransfer(f"bench-raw-{args.worker_id}-tp{rank}")
    try:
        raw.register_local(pool.regions())
        r = Rank(args, rank, tp, pool, client, raw)
        if rank == 0:
            drv = Driver(r, d)
            result: dict[str, Any] = {"tp": tp, "block_kib": args.block_kib, "hashes": args.hashes,
                                      "reps": args.reps, "poll_us": args.poll_us}
            try:
                if args.registry_mirror and not client.wait_registry_mirror(60):
                    raise Abort("the registry mirror did not get a complete copy in 60 s")
                result["first_contact"] = drv.first_contact()
                result["first_contact_bytes"] = layout.block_bytes * tp
                result["full"] = drv.series(args.hashes, "full", args.reps, with_memcpy=True)
                result["one"] = drv.series(1, "one", args.reps, with_memcpy=False)
                if args.stream_requests > 0:
                    result["stream"] = drv.stream_series(args.hashes, args.stream_requests, args.stream_depth,
                                                         args.stream_rounds)
                result["client_stats"] = dict(client.stats)
            except Exception as e:
                result["error"] = f"{type(e).__name__}: {e}"
                if not isinstance(e, Abort):
                    result["traceback"] = traceback.format_exc()
                (d / "abort").touch()
            write_json(d / "result.json", result)
            if "error" not in result:
                try:
                    drv.broadcast({"op": "stop"})
                except Abort:
                    pass
        else:
            follow(r, d, deadline)
        common._events_on.clear()
        write_json(d / f"events-{rank}.json", [list(e) for e in EVENTS])
    finally:
        client.shutdown()
        raw.close()
        (d / f"done-{rank}").write_text("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
