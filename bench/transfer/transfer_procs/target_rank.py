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
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import select
import socket
import sys
import time
import traceback
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import numpy as np
from bench.transfer.transfer_procs import common
from bench.transfer.transfer_procs.common import (
    EVENTS,
    RecordingNixl,
    fingerprint_for,
    hash_of,
    make_layout,
    rank_stream,
    raw_agent_name,
    read_json,
    record,
    write_json,
)

from remote_g2.adapters.nixl_transfer import NixlTransfer
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.protocol.messages import BlockLayout
from remote_g2.target import TargetConfig, start_target_client
from remote_g2.target.tp_mapping import ReadPlanner

CMD_TIMEOUT_S = 60.0
RAW_TIMEOUT_S = 30.0


class Abort(Exception):
    """The run cannot go on (a wrong byte, a failed request, a rank that stopped answering)."""


class DestPool:
    """The rank's destination memory: a zeroed page-aligned buffer of ``num_blocks`` blocks."""

    def __init__(self, layout: BlockLayout) -> None:
        self._layout = layout
        n = layout.num_blocks * layout.block_bytes
        raw = np.zeros(n + 4096, dtype=np.uint8)
        off = (-raw.ctypes.data) % 4096
        self._raw = raw
        self.buf = raw[off:off + n]

    @property
    def layout(self) -> BlockLayout:
        return self._layout

    def regions(self) -> list[MemoryRegion]:
        return [MemoryRegion(self.buf.ctypes.data, self.buf.nbytes)]


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


def wait_until(t: float) -> None:
    """Sleep until ~2 ms before ``t``, then spin (so every rank starts within microseconds of ``t``)."""
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        if left > 0.002:
            time.sleep(left - 0.002)


class Rank:
    def __init__(self, args: argparse.Namespace, rank: int, tp: int, pool: DestPool, client: Any,
                 raw: NixlTransfer) -> None:
        self.args, self.rank, self.tp, self.pool, self.client, self.raw = args, rank, tp, pool, client, raw
        self.bb = pool.layout.block_bytes
        self.expected = rank_stream(rank, args.block_kib, args.hashes * self.bb)  # same TP: source rank == ours
        self.scratch = np.zeros_like(self.expected)

    def execute(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "zero":
            self.pool.buf[:cmd["n"] * cmd.get("copies", 1) * self.bb] = 0
            return {}
        if op == "check":  # ``copies`` destination copies of the first n blocks, each byte-exact
            n, copies = cmd["n"], cmd.get("copies", 1)
            got = self.pool.buf[:copies * n * self.bb].reshape(copies, n, self.bb)
            want = self.expected[:n * self.bb].reshape(1, n, self.bb)
            bad = np.flatnonzero((got != want).any(axis=2).ravel())
            return {"bytes_ok": bad.size == 0, "bad_blocks": bad[:10].tolist(), "num_bad": int(bad.size)}
        if op == "raw":
            return self.raw_read(cmd["nbytes"], cmd["t0"])
        if op == "raw_stream":
            return self.raw_stream(cmd["nbytes"], cmd["t0"], cmd["count"], cmd["depth"])
        if op == "memcpy":
            n = cmd["nbytes"]
            wait_until(cmd["t0"])
            t_start = time.monotonic()
            np.copyto(self.scratch[:n], self.expected[:n])
            return {"t_start": t_start, "t_end": time.monotonic()}
        if op == "stop":
            return {}
        raise Abort(f"unknown command {op!r}")

    def _replay(self, nbytes: int) -> tuple[str, np.ndarray, np.ndarray, np.ndarray]:
        """The descriptors of the client's last READ of ``nbytes`` bytes, and the bare agent on the source rank it
        read from (same memory, same addresses), loaded into the raw agent."""
        rec = RecordingNixl.instances[0]
        if nbytes not in rec.reads:
            raise Abort(f"rank {self.rank}: the client never read {nbytes} bytes; nothing to replay")
        peer, local, remote, sizes = rec.reads[nbytes]
        src_rank = int(peer.rsplit("-tp", 1)[1])  # remote-g2-source-{worker}-tp{rank}
        bare = raw_agent_name(self.args.source_worker_id, src_rank)
        if not self.raw.has_peer(bare):
            self.raw.add_peer(bare, (self.args.source_dir / f"raw-agent-{src_rank}.bin").read_bytes())
        return bare, local, remote, sizes

    def raw_stream(self, nbytes: int, t0: float, count: int, depth: int) -> dict[str, Any]:
        """``count`` raw READs of the client's descriptors from ``t0``, at most ``depth`` posted at once."""
        peer, local, remote, sizes = self._replay(nbytes)
        wait_until(t0)
        t_start = time.monotonic()
        posted, open_ = 0, []
        try:
            while posted < count or open_:
                while posted < count and len(open_) < depth:
                    open_.append(self.raw.start_read(peer, local, remote, sizes))
                    posted += 1
                for h in list(open_):
                    state = self.raw.poll(h)
                    if state == "error":
                        raise Abort(f"rank {self.rank}: a raw stream READ ended in error")
                    if state == "done":
                        self.raw.release(h)
                        open_.remove(h)
                if open_ and time.monotonic() - t_start > RAW_TIMEOUT_S:
                    raise Abort(f"rank {self.rank}: raw stream not done in {RAW_TIMEOUT_S} s")
                if open_ and all(h.state == "pending" for h in open_):
                    time.sleep(0.0002)
        finally:
            for h in open_:
                self.raw.release(h)
        return {"t_start": t_start, "t_end": time.monotonic()}

    def raw_read(self, nbytes: int, t0: float) -> dict[str, Any]:
        peer, local, remote, sizes = self._replay(nbytes)
        wait_until(t0)
        t_start = time.monotonic()
        h = self.raw.start_read(peer, local, remote, sizes)
        t_post = time.monotonic()
        try:
            while (state := self.raw.poll(h)) == "pending":
                if time.monotonic() - t_start > RAW_TIMEOUT_S:
                    raise Abort(f"rank {self.rank}: raw READ not done in {RAW_TIMEOUT_S} s")
                time.sleep(0.0002)
            t_end = time.monotonic()
        finally:
            self.raw.release(h)
        if state != "done":
            raise Abort(f"rank {self.rank}: raw READ ended in {state}")
        return {"t_start": t_start, "t_post": t_post, "t_end": t_end, "descriptors": len(sizes)}


class Bell:
    """A rank's doorbell: a Unix datagram socket others ring after writing a file it waits for.

    The files stay the truth (a ring can come before the socket exists); the
    bell only lets a waiting rank sleep in the kernel instead of polling the
    directory every few ms — a poller takes CPU and the GIL from the rank's
    target loop during a timed request, which the raw baseline never pays.
    """

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.setblocking(False)

    def wait(self, timeout_s: float) -> None:
        if select.select([self.sock], [], [], timeout_s)[0]:
            try:
                while self.sock.recv(64):
                    pass
            except BlockingIOError:
                pass

    @staticmethod
    def ring(path: Path) -> None:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
            try:
                s.sendto(b"!", str(path))
            except OSError:  # not bound yet, or its queue is full: it looks at the files anyway
                pass


def bell_path(d: Path, rank: int) -> Path:
    return d / f"bell-{rank}.sock"


def follow(r: Rank, d: Path, deadline: float) -> None:
    """Ranks > 0: run rank 0's commands until ``stop`` (command files, woken by this rank's bell)."""
    bell = Bell(bell_path(d, r.rank))
    seq = 0
    while True:
        path = d / f"cmd-{seq}.json"
        while not path.exists():
            if (d / "abort").exists() or time.monotonic() > deadline:
                return
            bell.wait(0.05)
        cmd = read_json(path)
        try:
            out = {"ok": True, **r.execute(cmd)}
        except Exception as e:
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        write_json(d / f"ack-{seq}-{r.rank}.json", out)
        Bell.ring(bell_path(d, 0))
        if cmd["op"] == "stop":
            return
        seq += 1


class Driver:
    """Rank 0: the sequence of requests and commands; everything it measures goes to ``result``."""

    def __init__(self, r: Rank, d: Path) -> None:
        self.r, self.d, self.seq, self.req = r, d, 0, 0
        self.windows = 0
        self.bell = Bell(bell_path(d, 0))
        self.kib = r.args.block_kib
        self.poll_s = r.args.poll_us / 1e6
        self.stream_poll_s = r.args.stream_poll_us / 1e6

    def broadcast(self, cmd: dict[str, Any]) -> list[dict[str, Any]]:
        """Run ``cmd`` on every rank (this one included); every rank's answer, by rank."""
        write_json(self.d / f"cmd-{self.seq}.json", cmd)
        for rank in range(1, self.r.tp):
            Bell.ring(bell_path(self.d, rank))
        try:
            mine = {"ok": True, **self.r.execute(cmd)}
        except Abort as e:
            mine = {"ok": False, "error": str(e)}
        out = [mine]
        deadline = time.monotonic() + CMD_TIMEOUT_S
        for rank in range(1, self.r.tp):
            path = self.d / f"ack-{self.seq}-{rank}.json"
            while not path.exists():
                if time.monotonic() > deadline:
                    raise Abort(f"rank {rank} did not answer {cmd['op']} in {CMD_TIMEOUT_S} s")
                self.bell.wait(0.05)
            out.append(read_json(path))
        self.seq += 1
        bad = [f"rank {i}: {a.get('error') or a}" for i, a in enumerate(out) if not a.get("ok", True)]
        if bad:
            raise Abort(f"{cmd['op']} failed: " + "; ".join(bad))
        return out

    def e2e(self, n: int, kind: str, rep: int) -> dict[str, Any]:
        client = self.r.client
        hashes = [hash_of(self.kib, i) for i in range(n)]
        self.req += 1
        req = f"req-{self.req}"
        t0 = time.monotonic()
        m = client.lookup(hashes)
        t_lookup = time.monotonic()
        if m.matched != n:
            raise Abort(f"lookup of {n} hashes matched {m.matched} ({m.reason})")
        client.start_load(req, hashes, list(range(n)))
        t_started = time.monotonic()
        while True:
            done, failed = client.get_finished()
            if req in done:
                break
            if req in failed:
                bad = sorted(client.invalid_block_ids())[:8]
                raise Abort(f"{req} failed (see the rank logs); invalid blocks {bad}")
            if time.monotonic() - t0 > 30:
                raise Abort(f"{req} did not finish in 30 s")
            if self.poll_s > 0:
                time.sleep(self.poll_s)
            else:  # block until an outcome is posted: no polling thread taking the CPUs the READs copy with
                client.wait_finished(0.1)
        t_end = time.monotonic()
        invalid = client.invalid_block_ids()
        if invalid:
            raise Abort(f"{req} done but blocks {sorted(invalid)[:8]} are invalid")
        record("e2e", t0, t_end, [kind, rep])
        return {"t0": t0, "t_lookup": t_lookup, "t_started": t_started, "t_end": t_end, "s": t_end - t0}

    def stream(self, n: int, count: int, depth: int) -> dict[str, Any]:
        """``count`` requests of ``n`` blocks, at most ``depth`` in flight; request i lands in copy ``i % depth``.

        Each request is ``lookup -> start_load`` as soon as a slot is free; the
        loop polls ``get_finished`` every ``--stream-poll-us``, like an engine
        calling it once per step (a fast one: real steps take several ms).
        """
        client = self.r.client
        hashes = [hash_of(self.kib, i) for i in range(n)]
        free = list(range(depth))
        open_: dict[str, int] = {}  # request id -> destination copy
        issued = 0
        t0 = time.monotonic()
        while issued < count or open_:
            while issued < count and free:
                copy = free.pop(0)
                self.req += 1
                req = f"req-{self.req}"
                m = client.lookup(hashes)
                if m.matched != n:
                    raise Abort(f"stream: lookup of {n} hashes matched {m.matched} ({m.reason})")
                client.start_load(req, hashes, list(range(copy * n, (copy + 1) * n)))
                open_[req] = copy
                issued += 1
            done, failed = client.get_finished()
            if failed & open_.keys():
                bad = sorted(client.invalid_block_ids())[:8]
                raise Abort(f"stream: {sorted(failed & open_.keys())} failed; invalid blocks {bad}")
            for req in done & open_.keys():
                free.append(open_.pop(req))
            if time.monotonic() - t0 > 60:
                raise Abort(f"stream of {count} requests did not finish in 60 s")
            if open_ and not (done & open_.keys()):
                time.sleep(self.stream_poll_s)
        t_end = time.monotonic()
        invalid = client.invalid_block_ids()
        if invalid:
            raise Abort(f"stream done but blocks {sorted(invalid)[:8]} are invalid")
        record("stream", t0, t_end, [count, depth])
        return {"t0": t0, "t_end": t_end, "s": t_end - t0}

    def stream_series(self, n: int, count: int, depth: int, rounds: int) -> dict[str, Any]:
        """Alternating rounds of an e2e stream and a raw stream of the same requests; the last is checked."""
        per_rank = n * self.r.bb
        out: dict[str, Any] = {"blocks": n, "bytes": per_rank * self.r.tp * count, "requests": count,
                               "depth": depth, "e2e": [], "raw": []}
        for rnd in range(rounds):
            last = rnd == rounds - 1
            for step in (["e2e", "raw"] if rnd % 2 == 0 else ["raw", "e2e"]):
                if step == "e2e":
                    if last:
                        self.broadcast({"op": "zero", "n": n, "copies": depth})
                    out["e2e"].append(self.stream(n, count, depth))
                    if last:
                        self.check_copies(n, depth, f"the last stream of {count} requests")
                else:
                    with self.raw_window():
                        t0 = time.monotonic() + 0.02
                        acks = self.broadcast({"op": "raw_stream", "nbytes": per_rank, "t0": t0, "count": count,
                                               "depth": depth})
                    out["raw"].append({"t0": t0, "s": max(a["t_end"] for a in acks) - t0})
        return out

    @contextlib.contextmanager
    def raw_window(self) -> Iterator[None]:
        """With ``--raw-window``: the source ranks drive their bare agents fast until the block ends (each rank
        acknowledges both ends, so no end-to-end request ever runs beside a fast-driven agent)."""
        if not self.r.args.raw_window:
            yield
            return
        src = self.r.args.source_dir
        self.windows += 1
        flag = src / "raw-progress"

        def acked(text: str) -> None:
            deadline = time.monotonic() + 10
            for rank in range(self.r.tp):
                path = src / f"raw-progress-ack-{rank}"
                while True:
                    try:
                        if read_json(path) == text:
                            break
                    except (OSError, ValueError):
                        pass
                    if time.monotonic() > deadline:
                        raise Abort(f"source rank {rank} did not acknowledge raw window {text!r} in 10 s")
                    time.sleep(0.001)

        tmp = src / "raw-progress.tmp"
        tmp.write_text(str(self.windows))
        os.replace(tmp, flag)
        try:
            acked(f"on {self.windows}")
            yield
        finally:
            flag.unlink()
        acked(f"off {self.windows}")

    def check_copies(self, n: int, copies: int, what: str) -> None:
        acks = self.broadcast({"op": "check", "n": n, "copies": copies})
        bad = {rank: a for rank, a in enumerate(acks) if not a["bytes_ok"]}
        if bad:
            raise Abort(f"WRONG BYTES after {what}: " + "; ".join(
                f"rank {rank}: {a['num_bad']} bad block(s) (copy * n + block), first {a['bad_blocks']}"
                for rank, a in bad.items()))

    def synced(self, op: str, nbytes: int) -> dict[str, Any]:
        t0 = time.monotonic() + 0.02
        acks = self.broadcast({"op": op, "nbytes": nbytes, "t0": t0})
        return {"t0": t0, "s": max(a["t_end"] for a in acks) - t0,
                "rank_s": [a["t_end"] - a["t_start"] for a in acks],
                "start_late_s": [a["t_start"] - t0 for a in acks],
                "post_s": [a["t_post"] - a["t_start"] for a in acks if "t_post" in a],
                "descriptors": [a["descriptors"] for a in acks if "descriptors" in a]}

    def raw(self, per_rank: int) -> dict[str, Any]:
        with self.raw_window():
            return self.synced("raw", per_rank)

    def check(self, n: int, what: str) -> None:
        self.check_copies(n, 1, what)

    def first_contact(self) -> dict[str, Any]:
        """The target's first request: 1 block from a source it never talked to (metadata, connections), checked."""
        self.broadcast({"op": "zero", "n": 1})
        out = self.e2e(1, "first", -1)
        self.check(1, "the first contact")
        return out

    def series(self, n: int, kind: str, reps: int, with_memcpy: bool) -> dict[str, Any]:
        bb = self.r.bb
        per_rank = n * bb
        out: dict[str, Any] = {"blocks": n, "bytes": per_rank * self.r.tp, "e2e": [], "raw": [], "memcpy": []}
        # warm-up: the first request of this size (checked), the raw agent's first READ (zeroed, checked)
        self.broadcast({"op": "zero", "n": n})
        out["warmup_e2e"] = self.e2e(n, kind, -1)
        self.check(n, f"the first {kind} request")
        self.broadcast({"op": "zero", "n": n})
        out["warmup_raw"] = self.raw(per_rank)
        self.check(n, f"the first raw {kind} READ")
        if with_memcpy:
            self.synced("memcpy", per_rank)
        for rep in range(reps):
            last = rep == reps - 1
            steps = ["e2e", "raw", "memcpy"] if rep % 2 == 0 else ["raw", "memcpy", "e2e"]
            for step in steps:
                if step == "e2e":
                    if last:
                        self.broadcast({"op": "zero", "n": n})
                    out["e2e"].append(self.e2e(n, kind, rep))
                    if last:
                        self.check(n, f"the last {kind} request")
                elif step == "raw":
                    out["raw"].append(self.raw(per_rank))
                elif with_memcpy:
                    out["memcpy"].append(self.synced("memcpy", per_rank))
        return out


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
