"""The transport floor under a resolve: its four hops with no work at any of them, over four transports.

A resolve goes target → source rank 0 (ZMQ over TCP) → its sibling (ZMQ IPC)
→ rank 0 → target. This benchmark builds the same chain out of three
processes that only decode and re-encode the frames (the project's codec, a
real ``resolve`` of ``--hashes`` hashes and its ``sibling_pin``), so what it
measures is what the sockets, the I/O threads and the process wake-ups cost
on this machine — the part of ``bench_source.py``'s resolve time that no
change to the source's handlers can remove. Each round trip follows an idle
gap (``--idle-ms``), as between an engine's loads, and with ``--copy-mib N``
also a copy of N MiB on both CPUs (two threads, half each) right before it,
as a fetch's READs leave the caches for the next fetch's resolve (on one
host NIXL's READ is a CPU copy, so a 64 MiB fetch runs its successor's chain
cold).

Four chains, interleaved (each round of ``--rounds`` runs every chain in
turn, so a noisy minute hits all of them):

* ``zmq/zmq``: what the source runs (DESIGN.md): ZMQ over TCP, then ZMQ IPC;
* ``zmq/unix``: the sibling hop as a plain Unix stream socket with
  length-prefixed frames, as the target's ranks talk (``remote_g2/rpc/local_link.py``);
* ``tcp/unix``: no ZMQ at all — a plain TCP socket (``TCP_NODELAY``) in front;
* ``zmq/capture``: the source's transports, but rank 0 serves through a ZMQ
  proxy (as its pooled server does) whose *capture* socket copies each
  request, in C, to the sibling as it arrives: the sibling starts before
  rank 0's Python has read the request. Not what the source does today; it
  measures what that fan-out would take off the chain.

The gap between the rows is what replacing a transport (or the capture
fan-out) could save a resolve; ``tcp/unix`` is the floor of the design's hop
sequence itself.

    python -m bench.diagnostics.bench_resolve_floor [--rounds 300] [--hashes 512] [--idle-ms 0,20] [--copy-mib 0,64]
                                        [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import socket
import statistics
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import zmq

from bench.common import pct, write_result
from remote_g2.protocol.messages import Resolve, SiblingPin
from remote_g2.protocol.wire import decode_frame, decode_request_body, encode_request

CHAINS = ("zmq/zmq", "zmq/unix", "tcp/unix", "zmq/capture")
STOP = b"stop"
_LEN = struct.Struct(">I")
IO_TIMEOUT_S = 10.0  # a dead chain ends the run with an error instead of hanging it


# -- length-prefixed frames on a stream socket (what local_link.py sends, minus its validation) ------------------


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("peer closed")
        buf += chunk
    return bytes(buf)


def _recv_frame(sock: socket.socket) -> bytes:
    (length,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return _recv_exact(sock, length)


def _send_frame(sock: socket.socket, frame: bytes) -> None:
    sock.sendall(_LEN.pack(len(frame)) + frame)


class _Pipe:
    """One side of a hop: ``send(frame)`` / ``recv() -> frame``, over ZMQ or a plain stream socket."""

    def __init__(self, send: Callable[[bytes], None], recv: Callable[[], bytes], close: Callable[[], None]) -> None:
        self.send, self.recv, self.close = send, recv, close


def _zmq_dealer(endpoint: str) -> _Pipe:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.rcvtimeo = int(IO_TIMEOUT_S * 1000)
    sock.connect(endpoint)
    return _Pipe(sock.send, sock.recv, lambda: sock.close(linger=1000))


def _stream_client(family: int, address: object) -> _Pipe:
    deadline = time.monotonic() + IO_TIMEOUT_S
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.connect(address)
            break
        except OSError:
            sock.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    if family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(IO_TIMEOUT_S)
    return _Pipe(lambda f: _send_frame(sock, f), lambda: _recv_frame(sock), sock.close)


def _serve(kind: str, address: object, handle: Callable[[bytes], bytes | None]) -> None:
    """Answer frames on ``address`` (ZMQ ROUTER, or one accepted stream) with ``handle`` until it returns None."""
    if kind == "zmq":
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        sock.bind(str(address))
        try:
            while True:
                peer, raw = sock.recv_multipart()
                out = handle(raw)
                if out is None:
                    return
                sock.send_multipart([peer, out])
        finally:
            sock.close(linger=0)
    family = socket.AF_UNIX if kind == "unix" else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_INET:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(address)
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()
    if family == socket.AF_INET:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        while True:
            try:
                raw = _recv_frame(conn)
            except EOFError:
                return
            out = handle(raw)
            if out is None:
                return
            _send_frame(conn, out)
    finally:
        conn.close()


def _connect(kind: str, address: object) -> _Pipe:
    if kind == "zmq":
        return _zmq_dealer(str(address))
    return _stream_client(socket.AF_UNIX if kind == "unix" else socket.AF_INET, address)


# -- the three processes -------------------------------------------------------------------------------------------


def _sibling(kind: str, address: object) -> None:
    """Rank 1: decode each sibling_pin and send it back."""

    def handle(raw: bytes) -> bytes | None:
        if raw == STOP:
            return None
        return encode_request(1, decode_request_body(decode_frame(raw))[1])

    _serve(kind, address, handle)


def _rank0(front_kind: str, front: object, sibling_kind: str, sibling: object) -> None:
    """Rank 0: decode the resolve, forward a sibling_pin, wait for it, answer."""
    down = _connect(sibling_kind, sibling)

    def handle(raw: bytes) -> bytes | None:
        if raw == STOP:
            down.send(STOP)
            return None
        req = decode_request_body(decode_frame(raw))[1]
        down.send(encode_request(1, SiblingPin(1, req.hashes, req.ttl_ms, b"bench")))
        decode_request_body(decode_frame(down.recv()))
        return raw

    try:
        _serve(front_kind, front, handle)
    finally:
        down.close()


def _sibling_capture(address: str, answer_to: str) -> None:
    """Rank 1 of the capture chain: every frame rank 0's proxy saw arrives here; answer the resolves."""
    ctx = zmq.Context.instance()
    inbox, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.bind(address)
    out.connect(answer_to)
    try:
        while True:
            frames = inbox.recv_multipart()
            if frames[-1] == STOP:
                return
            frame = decode_frame(frames[-1])
            if frame.type != "resolve":
                continue  # the proxy also copies rank 0's replies here
            req = decode_request_body(frame)[1]
            out.send(encode_request(1, SiblingPin(1, req.hashes, req.ttl_ms, b"bench")))
    finally:
        inbox.close(linger=0)
        out.close(linger=1000)


def _rank0_capture(front: str, sibling: str, answers: str) -> None:
    """Rank 0 of the capture chain: a ZMQ proxy in C copies each request to the sibling as it arrives."""
    ctx = zmq.Context.instance()
    router, back, capture = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    router.bind(front)
    back.bind("inproc://handlers")
    capture.connect(sibling)
    proxy = threading.Thread(target=zmq.proxy, args=(router, back, capture), daemon=True)
    proxy.start()
    handler, inbox = ctx.socket(zmq.DEALER), ctx.socket(zmq.PULL)
    handler.connect("inproc://handlers")
    inbox.bind(answers)
    while True:
        peer, raw = handler.recv_multipart()
        if raw == STOP:
            return  # daemon proxy thread; the process ends
        decode_request_body(decode_frame(raw))
        decode_request_body(decode_frame(inbox.recv()))
        handler.send_multipart([peer, raw])


def _free_tcp_port() -> int:
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    port = probe.getsockname()[1]
    probe.close()
    return port


class Chain:
    """One chain's two server processes and the target's connection to rank 0."""

    def __init__(self, name: str, tmp: str) -> None:
        front_kind, sibling_kind = name.split("/")
        self.name = name
        ctx = mp.get_context("spawn")
        sibling: object = (f"ipc://{tmp}/{name.replace('/', '-')}.sock" if sibling_kind in ("zmq", "capture")
                           else f"{tmp}/{name.replace('/', '-')}.sock")
        port = _free_tcp_port()
        front: object = f"tcp://127.0.0.1:{port}" if front_kind == "zmq" else ("127.0.0.1", port)
        if sibling_kind == "capture":
            answers = f"ipc://{tmp}/capture-answers.sock"
            self.procs = [ctx.Process(target=_sibling_capture, args=(sibling, answers), daemon=True),
                          ctx.Process(target=_rank0_capture, args=(front, sibling, answers), daemon=True)]
        else:
            self.procs = [ctx.Process(target=_sibling, args=(sibling_kind, sibling), daemon=True),
                          ctx.Process(target=_rank0, args=(front_kind, front, sibling_kind, sibling), daemon=True)]
        for p in self.procs:
            p.start()
        self.pipe = _connect(front_kind, front)

    def round_trip(self, frame: bytes) -> float:
        t0 = time.perf_counter()
        self.pipe.send(frame)
        decode_request_body(decode_frame(self.pipe.recv()))
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.pipe.send(STOP)
        except (zmq.ZMQError, OSError):
            pass
        self.pipe.close()
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()


class Copier:
    """Copies ``mib`` MiB on two threads at once (numpy lets go of the GIL), as two target ranks' READs do."""

    def __init__(self, mib: int) -> None:
        half = (mib << 20) // 2
        self.src = [np.ones(half, np.uint8), np.ones(half, np.uint8)]
        self.dst = [np.zeros(half, np.uint8), np.zeros(half, np.uint8)]

    def copy(self) -> None:
        helper = threading.Thread(target=np.copyto, args=(self.dst[1], self.src[1]))
        helper.start()
        np.copyto(self.dst[0], self.src[0])
        helper.join()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="round trips per chain and idle gap (at most 5000)")
    ap.add_argument("--hashes", type=int, default=512, help="hashes in the resolve (1..65536)")
    ap.add_argument("--idle-ms", default="0,20", help="sleep before each round trip, ms, comma-separated (0..100)")
    ap.add_argument("--copy-mib", default="0",
                    help="also copy this many MiB right before each round trip, comma-separated (0..1024)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rounds = max(10, min(args.rounds, 5000))
    hashes = max(1, min(args.hashes, 65536))
    idles = [float(x) / 1000 for x in args.idle_ms.split(",") if x.strip()]
    if any(i < 0 or i > 0.1 for i in idles):
        raise SystemExit("--idle-ms: each value in 0..100")
    copies = [int(x) for x in args.copy_mib.split(",") if x.strip()]
    if not copies or any(c < 0 or c > 1024 for c in copies):
        raise SystemExit("--copy-mib: each value in 0..1024")
    cells = [(idle, mib) for mib in copies for idle in idles]
    copiers = {mib: Copier(mib) for mib in copies if mib}
    tmp = tempfile.mkdtemp(prefix="remote-g2-floor-")
    frame = encode_request(1, Resolve([os.urandom(16) for _ in range(hashes)], 10_000, "bench"))
    chains: list[Chain] = []
    times: dict[tuple[str, float, int], list[float]] = {}
    try:
        for name in CHAINS:
            chains.append(Chain(name, tmp))
        for chain in chains:  # connect and warm up
            for _ in range(5):
                chain.round_trip(frame)
        for idle, mib in cells:
            for _ in range(rounds):
                for chain in chains:
                    time.sleep(idle)
                    if mib:
                        copiers[mib].copy()
                    times.setdefault((chain.name, idle, mib), []).append(chain.round_trip(frame))
    finally:
        for chain in chains:
            chain.close()
    rows = []
    for idle, mib in cells:
        for name in CHAINS:
            ts = sorted(times[(name, idle, mib)])
            rows.append({"chain": name, "idle_ms": idle * 1000, "copy_mib": mib,
                         "p50_us": statistics.median(ts) * 1e6,
                         "p90_us": pct(ts, 90) * 1e6})
    base = {(r["idle_ms"], r["copy_mib"]): r["p50_us"] for r in rows if r["chain"] == CHAINS[0]}
    print(f"resolve-shaped chain (target -> rank 0 -> sibling and back), {hashes} hashes, frames decoded and "
          f"re-encoded, no other work; {rounds} round trips per cell, interleaved; {os.cpu_count()} CPUs, "
          f"{platform.machine()}")
    print(f"{'chain':>11} {'idle ms':>8} {'copy MiB':>8} {'p50 us':>8} {'p90 us':>8} {'vs zmq/zmq':>10}")
    for r in rows:
        r["p50_vs_zmq"] = r["p50_us"] / base[(r["idle_ms"], r["copy_mib"])]
        print(f"{r['chain']:>11} {r['idle_ms']:>8g} {r['copy_mib']:>8} {r['p50_us']:>8.0f} {r['p90_us']:>8.0f} "
              f"{r['p50_vs_zmq']:>10.2f}")
    print("  zmq/zmq: the source's transports (ZMQ TCP in front, ZMQ IPC to the sibling); zmq/unix: the sibling hop\n"
          "  on a Unix stream socket; tcp/unix: no ZMQ at all; zmq/capture: rank 0's proxy copies each request to the\n"
          "  sibling as it arrives (not what the source runs); copy MiB: copied on both CPUs before each round trip")
    if args.json:
        write_result(args.json, "resolve_floor", args=vars(args), hashes=hashes, rounds=rounds, copy_mib=copies,
                     rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
