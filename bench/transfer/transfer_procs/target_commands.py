"""Every rank of the transfer benchmark's target worker: its destination memory and the commands it runs.

* :class:`DestPool`: the rank's destination memory, page-aligned, that the target client and the raw agent
  both read into;
* :class:`Rank`: the commands rank 0 sends every rank (``zero``, ``check``, ``raw``, ``raw_stream``,
  ``memcpy``, ``stop``; see ``target_rank``), run on this rank's pool, client and bare raw agent;
* :class:`Bell`, :func:`bell_path`, :func:`follow`: how a rank > 0 waits for the command files rank 0 writes
  and answers them (rank 0's side is ``target_driver.Driver``);
* :class:`Abort`: the run cannot go on.
"""

from __future__ import annotations

import argparse
import select
import socket
import time
from pathlib import Path
from typing import Any

import numpy as np
from bench.transfer.transfer_procs.common import RecordingNixl, rank_stream, raw_agent_name, read_json, write_json

from remote_g2.adapters.nixl_transfer import NixlTransfer
from remote_g2.memory.secondary_pool import MemoryRegion
from remote_g2.protocol.messages import BlockLayout

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


def wait_until(t: float) -> None:
    """Sleep until ~2 ms before ``t``, then spin (so every rank starts within microseconds of ``t``)."""
    while True:
        left = t - time.monotonic()
        if left <= 0:
            return
        if left > 0.002:
            time.sleep(left - 0.002)


class Rank:
    """One rank's side of every command: its pool, its target client and its bare raw agent."""

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
