"""The transport floor under a resolve: its four ZMQ hops with no work at any of them.

A resolve goes target → source rank 0 (ZMQ over TCP) → its sibling (ZMQ IPC)
→ rank 0 → target. This benchmark builds the same chain out of three
processes that only decode and re-encode the frames (the project's codec, a
real ``resolve`` of ``--hashes`` hashes and its ``sibling_pin``), so what it
measures is what the sockets, the ZMQ I/O threads and the process wake-ups
cost on this machine — the part of ``bench_source.py``'s resolve time that no
change to the source's handlers can remove. Each round trip follows an idle
gap (``--idle-ms``), as between an engine's loads.

    python bench/bench_resolve_floor.py [--rounds 300] [--hashes 512] [--idle-ms 0,20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import zmq

from remote_g2.messages import Resolve, SiblingPin
from remote_g2.wire import decode_frame, decode_request_body, encode_request


def _sibling(endpoint: str) -> None:
    """Rank 1: decode each sibling_pin and send it back."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.bind(endpoint)
    while True:
        peer, raw = sock.recv_multipart()
        if raw == b"stop":
            break
        msg = decode_request_body(decode_frame(raw))[1]
        sock.send_multipart([peer, encode_request(1, msg)])
    sock.close(linger=0)


def _rank0(endpoint: str, sibling: str) -> None:
    """Rank 0: decode the resolve, forward a sibling_pin, wait for it, answer."""
    ctx = zmq.Context.instance()
    front = ctx.socket(zmq.ROUTER)
    front.bind(endpoint)
    down = ctx.socket(zmq.DEALER)
    down.connect(sibling)
    while True:
        peer, raw = front.recv_multipart()
        if raw == b"stop":
            down.send(b"stop")
            break
        req = decode_request_body(decode_frame(raw))[1]
        down.send(encode_request(1, SiblingPin(1, req.hashes, req.ttl_ms)))
        decode_request_body(decode_frame(down.recv()))
        front.send_multipart([peer, raw])
    front.close(linger=0)
    down.close(linger=1000)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300, help="round trips per idle gap (at most 5000)")
    ap.add_argument("--hashes", type=int, default=512, help="hashes in the resolve (1..65536)")
    ap.add_argument("--idle-ms", default="0,20", help="sleep before each round trip, ms, comma-separated (0..100)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rounds = max(10, min(args.rounds, 5000))
    hashes = max(1, min(args.hashes, 65536))
    idles = [float(x) / 1000 for x in args.idle_ms.split(",") if x.strip()]
    if any(i < 0 or i > 0.1 for i in idles):
        raise SystemExit("--idle-ms: each value in 0..100")
    tmp = tempfile.mkdtemp(prefix="remote-g2-floor-")
    sibling = f"ipc://{tmp}/sibling.sock"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_sibling, args=(sibling,), daemon=True)]
    procs[0].start()
    probe = zmq.Context.instance().socket(zmq.ROUTER)
    port = probe.bind_to_random_port("tcp://127.0.0.1")
    probe.close(linger=0)
    front = f"tcp://127.0.0.1:{port}"
    procs.append(ctx.Process(target=_rank0, args=(front, sibling), daemon=True))
    procs[1].start()
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.rcvtimeo = 10_000  # a dead chain ends the run with zmq.Again instead of hanging it
    sock.connect(front)
    frame = encode_request(1, Resolve([os.urandom(16) for _ in range(hashes)], 10_000, "bench"))
    rows = []
    try:
        for _ in range(5):  # connect and warm up
            sock.send(frame)
            sock.recv()
        for idle in idles:
            times = []
            for _ in range(rounds):
                time.sleep(idle)
                t0 = time.perf_counter()
                sock.send(frame)
                decode_request_body(decode_frame(sock.recv()))
                times.append(time.perf_counter() - t0)
            times.sort()
            rows.append({"idle_ms": idle * 1000, "p50_us": statistics.median(times) * 1e6,
                         "p90_us": times[min(len(times) - 1, int(0.9 * len(times)))] * 1e6})
    finally:
        try:
            sock.send(b"stop")
        except zmq.ZMQError:
            pass
        sock.close(linger=1000)
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    print(f"resolve-shaped ZMQ chain (target -> rank 0 over TCP -> sibling over IPC and back), {hashes} hashes, "
          f"no work; {rounds} round trips per row; {os.cpu_count()} CPUs, {platform.machine()}")
    print(f"{'idle ms':>8} {'p50 us':>8} {'p90 us':>8}")
    for r in rows:
        print(f"{r['idle_ms']:>8g} {r['p50_us']:>8.0f} {r['p90_us']:>8.0f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"benchmark": "resolve_floor", "hashes": hashes, "rounds": rounds,
                                         "cpus": os.cpu_count(), "rows": rows}, indent=2))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
