"""One TP rank of the gather benchmark's target worker:
``mpiexec -n T python -m bench.transfer.gather_procs.target_rank ...``.

Every rank starts the real target client (NIXL) over a destination pool of
the model's layout at TP T (destination blocks ``0..N-1``), plus a bare NIXL
transfer adapter of its own on the same memory for the raw baselines, and
plans, with the client's own planner, the descriptors today's in-place path
reads (one per head slice of each block, or one per scattered block). Rank 0
drives; the other ranks follow its commands over a ZMQ IPC socket
(``DIR/ctl``) and answer each:

* ``raw`` of a ``kind``, every rank starting at the shared instant ``t0``
  (``time.monotonic``, one clock on one host): ``slices`` — the in-place
  path's descriptors; ``contig`` — the same number of bytes from each source
  rank as one descriptor (the ideal: what the bytes cost when nothing is
  scattered); ``one`` — one block's share as one descriptor. The time is
  until the slowest rank's READ is done;
* ``check`` — the first ``n`` destination blocks against the bytes the
  source ranks hold, mapped through the TP head slices (a wrong byte aborts);
  ``zero`` — clear them;
* ``bounce`` — turn this rank's bounce region (``target/bounce.py``) on or
  off for the requests that follow (a benchmark-only A/B).

Rank 0's sequence: a warm-up request (checked) and raw warm-ups (the sliced
one checked); then ``--reps`` rounds of {request gathered, request read in
place, raw sliced, raw contiguous} in an order that rotates every round; the
in-place request flips the client's ``gather`` setting for that one request
(a benchmark-only A/B). Where the warm-up request went through a bounce
region on some rank, each round also times both requests with every rank's
bounce region off (``gathered_no_bounce``, ``in_place_no_bounce``). Then
``--one-block-reps`` rounds of {1-block request, raw one-descriptor READ,
1-block request with peer resolve off (the classic strategy), one RPC
round trip to source rank 0 (``ping``)}. The
last full request lands in zeroed blocks and is checked. Results go to
``DIR/result.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from bench.transfer.gather_procs.layouts import block_stream, fingerprint_for, hash_of, layout_for
from bench.transfer.transfer_procs.common import write_json

from remote_g2.adapters.host_pool import HostPool
from remote_g2.adapters.nixl_transfer import NixlTransfer
from remote_g2.memory.extent_copy import copy_extents
from remote_g2.protocol.messages import BlockLayout, Ping, RankBlocks, RankInfo
from remote_g2.rpc.client import RpcClient
from remote_g2.target import TargetConfig, start_target_client
from remote_g2.target.tp_mapping import ReadPlanner

START_AHEAD_S = 0.003  # a raw READ starts this far after its command left rank 0: every rank is waiting by then


class Rank:
    """What every rank holds: its pool, raw adapter, sliced and contiguous descriptor lists, expected bytes."""

    def __init__(self, args: argparse.Namespace, rank: int, tp: int) -> None:
        self.rank, self.tp, self.n = rank, tp, args.blocks
        self.client: Any = None  # the rank's target client, once started
        spec = json.loads(args.spec)
        self.spec = spec
        self.layout = layout_for(spec, tp, self.n)
        self.pool = HostPool(self.layout, huge_pages=True)
        region = self.pool.regions()[0]
        self.base = region.base
        src_tp = args.source_tp
        infos = [json.loads((args.source_dir / f"info-{s}.json").read_text()) for s in range(src_tp)]
        rank_infos = [RankInfo(s, i["raw_agent"], None, i["pool_base"], i["pool_bytes"], BlockLayout(**i["layout"]))
                      for s, i in enumerate(infos)]
        planner = ReadPlanner(source_tp=src_tp, source_ranks=rank_infos, target_layout=self.layout,
                              target_base=self.base, target_tp=tp, target_rank=rank)
        blocks = [RankBlocks(s, i["block_of"]) for s, i in enumerate(infos)]
        self.slices = planner.plan(blocks, list(range(self.n)))
        self.raw = NixlTransfer(f"bench-gather-raw-{args.worker_id}-tp{rank}")
        self.raw.register_local(self.pool.regions())
        for reads in self.slices.reads:
            s = reads.source_rank
            self.raw.add_peer(reads.agent_name, (args.source_dir / f"raw-agent-{s}.bin").read_bytes())
        u = np.uint64
        self.contig = []  # one descriptor per source rank read: the same bytes, nothing scattered
        offset = 0
        for reads in self.slices.reads:
            nbytes = reads.total_bytes
            self.contig.append((reads.agent_name, np.array([self.base + offset], dtype=u),
                                np.array([infos[reads.source_rank]["pool_base"]], dtype=u),
                                np.array([nbytes], dtype=u)))
            offset += nbytes
        first = self.slices.reads[0]
        one = self.layout.block_bytes // max(1, len(self.slices.reads))  # one block's share from one source rank
        self.one = (first.agent_name, np.array([self.base], dtype=u),
                    np.array([infos[first.source_rank]["pool_base"]], dtype=u), np.array([one], dtype=u))
        # Expected bytes: the source ranks' blocks rebuilt here, read through the same plan with memcpy.
        fake = {}
        for reads in self.slices.reads:
            s = reads.source_rank
            lay = rank_infos[s].layout
            arr = np.zeros(infos[s]["pool_bytes"], dtype=np.uint8)
            stream = block_stream(s, args.tag, self.n * lay.block_bytes)
            for i, b in enumerate(infos[s]["block_of"]):
                arr[b * lay.block_bytes:(b + 1) * lay.block_bytes] = stream[i * lay.block_bytes:(i + 1) * lay.block_bytes]
            fake[s] = arr
        self.expected = np.zeros(self.n * self.layout.block_bytes, dtype=np.uint8)
        fake_infos = [replace(ri, pool_base=int(fake[s].ctypes.data)) if s in fake else ri
                      for s, ri in enumerate(rank_infos)]
        exp_plan = ReadPlanner(source_tp=src_tp, source_ranks=fake_infos, target_layout=self.layout,
                               target_base=int(self.expected.ctypes.data), target_tp=tp,
                               target_rank=rank).plan(blocks, list(range(self.n)))
        for reads in exp_plan.reads:
            copy_extents(reads.local_addr, reads.remote_addr, reads.nbytes)
        self.expected_written = np.zeros(self.n * self.layout.block_bytes, dtype=bool)
        for reads in exp_plan.reads:  # the bytes a load writes (padding and other heads stay as they were)
            for a, n in zip((reads.local_addr - u(self.expected.ctypes.data)).tolist(), reads.nbytes.tolist()):
                self.expected_written[a:a + n] = True

    def dst(self) -> np.ndarray:
        return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * (self.n * self.layout.block_bytes))
                                     .from_address(self.base))

    def check(self, n: int) -> list[int]:
        """Destination blocks among the first ``n`` whose written bytes differ from the expected ones."""
        bb = self.layout.block_bytes
        got = self.dst()
        bad = []
        for b in range(n):
            sl = slice(b * bb, (b + 1) * bb)
            m = self.expected_written[sl]
            if not np.array_equal(got[sl][m], self.expected[sl][m]):
                bad.append(b)
        return bad

    def zero(self, n: int) -> None:
        self.dst()[:n * self.layout.block_bytes] = 0

    def raw_read(self, kind: str, t0: float) -> float:
        """One raw READ of ``kind`` starting at ``t0``; when it was done (monotonic)."""
        if kind == "slices":
            lists = [(r.agent_name, r.local_addr, r.remote_addr, r.nbytes) for r in self.slices.reads]
        elif kind == "contig":
            lists = self.contig
        else:
            lists = [self.one]
        while time.monotonic() < t0:
            pass
        handles = [self.raw.start_read(a, local, remote, nbytes) for a, local, remote, nbytes in lists]
        while True:
            states = [self.raw.poll(h) for h in handles]
            if "error" in states:
                raise RuntimeError(f"raw {kind} READ failed")
            if all(s == "done" for s in states):
                break
        done = time.monotonic()
        for h in handles:
            self.raw.release(h)
        return done

    def serve(self, msg: dict[str, Any]) -> dict[str, Any]:
        op = msg["op"]
        if op == "bounce":
            worker = self.client._worker  # benchmark-only A/B: the worker's region swapped out and back
            if not hasattr(self, "bounce_region"):
                self.bounce_region = worker._bounce
            worker._bounce = self.bounce_region if msg["on"] else None
            return {"bounced_reads": self.client.stats["bounced_reads"]}
        if op == "raw":
            return {"done": self.raw_read(msg["kind"], msg["t0"])}
        if op == "check":
            return {"bad": self.check(msg["n"])}
        if op == "zero":
            self.zero(msg["n"])
            return {}
        raise ValueError(f"unknown op {op!r}")


def follower(me: Rank, ctl: str) -> None:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(ctl)
    sock.send_json({"ready": me.rank})
    while True:
        msg = sock.recv_json()
        if msg["op"] == "stop":
            return
        try:
            sock.send_json(me.serve(msg))
        except Exception as e:
            sock.send_json({"error": f"{type(e).__name__}: {e}"})


class Leader:
    def __init__(self, me: Rank, client: Any, args: argparse.Namespace, ctl: str) -> None:
        self.me, self.client, self.args = me, client, args
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.bind(ctl)
        self.peers = []
        while len(self.peers) < me.tp - 1:
            ident, body = self.sock.recv_multipart()
            self.peers.append(ident)
        self.hashes = [hash_of(args.tag, i) for i in range(me.n)]
        self.req = 0
        self.config = client.config
        self.phase_ms: dict[str, dict[str, list[float]]] = {}  # kind -> phase -> ms of each request

    def all(self, msg: dict[str, Any]) -> list[dict[str, Any]]:
        for p in self.peers:
            self.sock.send_multipart([p, json.dumps(msg).encode()])
        mine = self.me.serve(msg)
        out = [mine]
        for _ in self.peers:
            _, body = self.sock.recv_multipart()
            reply = json.loads(body)
            if "error" in reply:
                raise RuntimeError(reply["error"])
            out.append(reply)
        return out

    def raw(self, kind: str) -> float:
        t0 = time.monotonic() + START_AHEAD_S
        return max(r["done"] for r in self.all({"op": "raw", "kind": kind, "t0": t0})) - t0

    def check(self, n: int, what: str) -> None:
        bad = [(i, r["bad"][:4]) for i, r in enumerate(self.all({"op": "check", "n": n})) if r["bad"]]
        if bad:
            raise RuntimeError(f"{what}: wrong bytes in destination blocks (rank, blocks): {bad}")

    def load(self, n: int, *, gather: bool = True, peer: bool = True, bounce: bool = True) -> float:
        """One request of the first ``n`` hashes, end to end (lookup to outcome); its seconds.

        ``peer`` False: the leader resolves every share (the classic strategy) even where the ranks could
        each ask their own source rank."""
        client = self.client
        # benchmark-only A/B of the settings
        client.coordinator.config = replace(self.config, gather=gather, peer_resolve=self.config.peer_resolve and peer)
        self.req += 1
        req = f"r{self.req}"
        before = self.phases()  # before the clock starts: reading the histograms costs ~0.1 ms
        t0 = time.perf_counter()
        m = client.lookup(self.hashes[:n])
        if m.matched < n:
            raise RuntimeError(f"lookup matched {m.matched} of {n}: {m.reason}")
        t_lookup = time.perf_counter()
        client.start_load(req, self.hashes[:n], list(range(n)))
        while True:
            done, failed = client.get_finished()
            if req in failed:
                raise RuntimeError(f"request {req} failed: {client.failure_reasons().get(req)}")
            if req in done:
                break
            client.wait_finished(1.0)
        took = time.perf_counter() - t0
        after = self.phases()
        name = f"{'gathered' if gather else 'in_place'}-{n}{'' if peer else '-classic'}{'' if bounce else '-no-bounce'}"
        kind = self.phase_ms.setdefault(name, {})
        kind.setdefault("lookup", []).append((t_lookup - t0) * 1000)
        for p in after:
            kind.setdefault(p, []).append((after[p][1] - before[p][1]) * 1000)
        return took

    def run(self) -> dict[str, Any]:
        n, reps = self.me.n, self.args.reps
        self.all({"op": "zero", "n": n})
        first = self.load(n)
        self.check(n, "the first (gathered) request")
        bounces = sum(r["bounced_reads"] for r in self.all({"op": "bounce", "on": True})) > 0
        self.all({"op": "zero", "n": n})
        self.load(n, gather=False)
        self.check(n, "the first in-place request")
        self.all({"op": "zero", "n": n})
        self.raw("slices")
        self.check(n, "the raw sliced READ")
        self.raw("contig")
        times: dict[str, list[float]] = {"gathered": [], "in_place": [], "raw_slices": [], "raw_contig": []}
        steps = [("gathered", lambda: self.load(n)), ("in_place", lambda: self.load(n, gather=False)),
                 ("raw_slices", lambda: self.raw("slices")), ("raw_contig", lambda: self.raw("contig"))]
        if bounces:
            for gather in (True, False):
                name = f"{'gathered' if gather else 'in_place'}_no_bounce"
                times[name] = []
                steps.append((name, lambda gather=gather: self.unbounced(n, gather)))
                self.all({"op": "zero", "n": n})
                self.unbounced(n, gather)  # warm-up, checked
                self.check(n, f"the first {name} request")
        for i in range(reps):
            for name, step in steps[i % len(steps):] + steps[:i % len(steps)]:
                times[name].append(step())
        one: dict[str, list[float]] = {"load": [], "load_classic": [], "raw_one": [], "rpc": []}
        endpoint = json.loads((self.args.source_dir / "endpoint.json").read_text())["endpoint"]
        with RpcClient(endpoint, timeout_ms=2000) as rpc:
            rpc.call(Ping())
            for i in range(self.args.one_block_reps):
                one["load"].append(self.load(1))
                one["raw_one"].append(self.raw("one"))
                one["load_classic"].append(self.load(1, peer=False))
                t = time.perf_counter()
                rpc.call(Ping())
                one["rpc"].append(time.perf_counter() - t)
        self.all({"op": "zero", "n": n})
        times["gathered"].append(self.load(n))
        self.check(n, "the last request")
        stats = self.client.stats
        return {"first_s": first, "times": times, "one": one, "descriptors_in_place": self.me.slices.num_descriptors,
                "bytes_per_rank": self.me.slices.total_bytes, "client_stats": dict(stats),
                "median": {k: statistics.median(v) for k, v in {**times, **one}.items()},
                "phase_medians_ms": {k: {p: statistics.median(v) for p, v in ph.items()}
                                     for k, ph in self.phase_ms.items()}}

    def unbounced(self, n: int, gather: bool) -> float:
        """One request with every rank's bounce region off (its seconds)."""
        self.all({"op": "bounce", "on": False})
        try:
            return self.load(n, gather=gather, bounce=False)
        finally:
            self.all({"op": "bounce", "on": True})

    def phases(self) -> dict[str, tuple[float, float]]:
        """The client's load-phase histogram: phase -> (count, seconds summed)."""
        reg = self.client.metrics.registry
        out = {p: (reg.get_sample_value("remote_g2_target_load_phase_seconds_count", {"phase": p}) or 0.0,
                   reg.get_sample_value("remote_g2_target_load_phase_seconds_sum", {"phase": p}) or 0.0)
               for p in ("to_resolve", "resolve", "reads")}
        # start_load to the outcome as the coordinator saw it (the rest of a request is the engine's wake-up)
        out["load"] = (reg.get_sample_value("remote_g2_target_load_seconds_count", {"outcome": "done"}) or 0.0,
                       reg.get_sample_value("remote_g2_target_load_seconds_sum", {"outcome": "done"}) or 0.0)
        return out

    def stop(self) -> None:
        for p in self.peers:
            self.sock.send_multipart([p, json.dumps({"op": "stop"}).encode()])


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True, type=Path)
    p.add_argument("--registry", required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--spec", required=True)
    p.add_argument("--tag", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--source-tp", type=int, required=True)
    p.add_argument("--source-dir", required=True, type=Path)
    p.add_argument("--ipc-dir", required=True)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--one-block-reps", type=int, default=30)
    p.add_argument("--registry-mirror", action="store_true", help="look up in an in-process registry mirror")
    args = p.parse_args()
    logging.basicConfig(level="WARNING", format=f"%(asctime)s %(levelname)s [pid {os.getpid()}] %(name)s: %(message)s")

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, tp = comm.Get_rank(), comm.Get_size()
    d: Path = args.dir
    me = Rank(args, rank, tp)
    spec = me.spec
    config = TargetConfig(enabled=True, registry_endpoint=args.registry, ipc_dir=args.ipc_dir,
                          fingerprint=fingerprint_for(spec, tp), transfer_timeout_ms=30_000, lease_ttl_ms=30_000,
                          registry_mirror=args.registry_mirror)
    client = start_target_client(me.pool, worker_id=args.worker_id, config=config, comm=comm)
    me.client = client
    if rank == 0 and args.registry_mirror and not client.wait_registry_mirror(30):
        raise SystemExit("the registry mirror took no snapshot in 30 s")
    ctl = f"ipc://{args.ipc_dir}/gather-bench-ctl"
    try:
        if rank == 0:
            leader = Leader(me, client, args, ctl)
            try:
                result = leader.run()
            except Exception as e:
                result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            finally:
                leader.stop()
            write_json(d / "result.json", result)
        else:
            follower(me, ctl)
    finally:
        client.shutdown()
        me.raw.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
