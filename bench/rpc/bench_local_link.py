"""Round trip between two processes of one worker: ZMQ IPC (as the RPC layer uses it) vs a local link.

Why the target's ranks talk over ``remote_g2.rpc.local_link`` instead of ZMQ IPC.
An echo process answers every message; the parent sends one ``target_done``
frame, waits for the echo, sleeps ``idle`` (so the other side's thread goes
back to sleep, as between loads), and repeats. Both sides encode and decode
with the project's codec, so the rows differ only in the transport:

* ``zmq``: a DEALER to a ROUTER over ``ipc://`` (what ``RpcMux`` and
  ``RpcServer`` do): each hop goes through the sender's and the receiver's
  ZMQ I/O threads;
* ``link``: a :class:`~remote_g2.rpc.local_link.MessageLink` on a Unix stream
  socket, read by the receiving thread after ``poll``.

Rounds alternate the two transports so machine noise hits both.

    python -m bench.rpc.bench_local_link [--rounds 300] [--idle-ms 0,2,10] [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import select
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import zmq

from bench.common import pct, write_result
from remote_g2.rpc.local_link import LinkListener, connect_link
from remote_g2.protocol.messages import TargetDone
from remote_g2.protocol.wire import decode_frame, decode_request_body, encode_request

MESSAGE = TargetDone(1, 1, True, "", 1 << 20, 16)


def _echo_zmq(endpoint: str, count: int) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    for i in range(count):
        peer, raw = sock.recv_multipart()
        msg = decode_request_body(decode_frame(raw))[1]
        sock.send_multipart([peer, encode_request(i + 1, msg)])
    sock.close(linger=1000)


def _echo_link(path: str, count: int) -> None:
    link = connect_link(path, rank=1, worker_id="bench", timeout_s=10)
    poller = select.poll()
    poller.register(link.fileno(), select.POLLIN)
    seen = 0
    while seen < count:
        if poller.poll(1000):
            for msg in link.receive():
                link.send(msg)
                seen += 1
    time.sleep(0.2)
    link.close()


def _zmq_rounds(endpoint: str, rounds: int, idle_s: float) -> list[float]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.rcvtimeo = 10_000  # a dead echo ends the run with zmq.Again instead of hanging it
    sock.connect(endpoint)
    out = []
    for i in range(rounds):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        sock.send(encode_request(i + 1, MESSAGE))
        decode_request_body(decode_frame(sock.recv()))
        out.append(time.perf_counter() - t0)
    sock.close(linger=0)
    return out


def _link_rounds(link: Any, rounds: int, idle_s: float) -> list[float]:
    poller = select.poll()
    poller.register(link.fileno(), select.POLLIN)
    out = []
    for _ in range(rounds):
        time.sleep(idle_s)
        t0 = time.perf_counter()
        link.send(MESSAGE)
        got: list[Any] = []
        deadline = time.monotonic() + 10
        while not got:
            if time.monotonic() > deadline:
                raise SystemExit("the link echo stopped answering")
            poller.poll(1000)
            got = link.receive()
        out.append(time.perf_counter() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="round trips per cell (at most 5000)")
    ap.add_argument("--idle-ms", default="0,2,10", help="sleep before each round trip, ms, comma-separated")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks per cell")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rounds = max(10, min(args.rounds, 5000))
    idles = [float(x) / 1000 for x in args.idle_ms.split(",") if x.strip()]
    if any(i < 0 or i > 0.1 for i in idles):
        raise SystemExit("--idle-ms: each value in 0..100")
    per_block = max(1, rounds // args.blocks)
    total = per_block * args.blocks * len(idles)
    tmp = tempfile.mkdtemp(prefix="remote-g2-link-bench-")
    endpoint, path = f"ipc://{tmp}/zmq.sock", f"{tmp}/link.sock"
    ctx = mp.get_context("spawn")
    zmq_echo = ctx.Process(target=_echo_zmq, args=(endpoint, total + 3), daemon=True)
    zmq_echo.start()
    listener = LinkListener(path)
    link_echo = ctx.Process(target=_echo_link, args=(path, total), daemon=True)
    link_echo.start()
    rows = []
    try:
        link = listener.accept_ranks({1}, "bench", timeout_s=30)[1]
        _zmq_rounds(endpoint, 3, 0.0)  # connect and warm up (the echo counts these 3)
        for idle in idles:
            zs: list[float] = []
            ls: list[float] = []
            for b in range(args.blocks):
                order = (0, 1) if b % 2 == 0 else (1, 0)
                for which in order:
                    if which == 0:
                        zs += _zmq_rounds(endpoint, per_block, idle)
                    else:
                        ls += _link_rounds(link, per_block, idle)
            row = {"idle_ms": idle * 1000,
                   "zmq_p50_us": statistics.median(zs) * 1e6, "zmq_p90_us": pct(zs, 90) * 1e6,
                   "link_p50_us": statistics.median(ls) * 1e6, "link_p90_us": pct(ls, 90) * 1e6}
            row["zmq_over_link"] = row["zmq_p50_us"] / row["link_p50_us"]
            rows.append(row)
    finally:
        listener.close()
        for p in (zmq_echo, link_echo):
            p.join(5)
            if p.is_alive():
                p.kill()
    print(f"round trip, ZMQ IPC vs local link; {per_block * args.blocks} per cell, interleaved; "
          f"{os.cpu_count()} CPUs, {platform.machine()}")
    print(f"{'idle ms':>8} {'zmq p50 us':>11} {'zmq p90':>8} {'link p50 us':>12} {'link p90':>9} {'zmq/link':>9}")
    for r in rows:
        print(f"{r['idle_ms']:>8g} {r['zmq_p50_us']:>11.0f} {r['zmq_p90_us']:>8.0f} {r['link_p50_us']:>12.0f} "
              f"{r['link_p90_us']:>9.0f} {r['zmq_over_link']:>8.1f}x")
    if args.json:
        write_result(args.json, "local_link", args=vars(args), rounds_per_cell=per_block * args.blocks, rows=rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
