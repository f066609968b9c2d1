"""What one hop of a fetch costs on this machine: the wake-up, and the same work done cold.

Every step of a remote fetch is a process woken by another (target leader →
source rank 0 → its sibling → rank 0 → leader → target rank 1 → leader),
which then does a little Python work and wakes the next. This benchmark
measures both parts on their own, in two processes and one Unix socket:

* ``round trip``: the parent sends a byte, the worker answers at once — two
  wake-ups, no work;
* ``plan, warm``: the work of one hop — a target rank planning its share of a
  64 MiB fetch (``ReadPlanner.plan``, TP 2→2, ``--blocks`` blocks) — run in a
  tight loop, caches hot;
* ``plan, woken``: the very same call, timed inside the worker right after the
  parent's message woke it, back to back and after ``--idle-ms`` of idling
  (as between an engine's loads); ``again``: the call once more right after.

If ``woken`` is several times ``warm``, a hop pays for running cold after the
wake-up; ``--plan-path both`` shows that the price depends on the code run:
it times the planner's two ways side by side, ``compiled`` (what it picks for
whole-block extents: one call into the ``_read_plan`` extension) and
``array`` (numpy always), warm and woken. ``--cpus same|split`` puts both
processes on one CPU or on two.

    python -m bench.diagnostics.bench_wake_cost [--rounds 300] [--blocks 32,512] [--idle-ms 0,20] [--plan-path compiled|array|both]
                                    [--json out.json]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import random
import socket
import statistics
import struct
import time
from pathlib import Path

from bench.common import pct, write_result
from remote_g2.protocol.messages import BlockLayout, RankBlocks, RankInfo
from remote_g2.target import tp_mapping
from remote_g2.target.tp_mapping import ReadPlanner

_TIME = struct.Struct("<dd")
IO_TIMEOUT_S = 10.0  # a dead worker ends the run with an error instead of hanging it
POOL_BLOCKS = 8192


def _planner_and_request(blocks: int) -> tuple[ReadPlanner, list[RankBlocks], list[int]]:
    """TP 2→2, 64 MiB over both ranks: ``blocks`` blocks per rank, scattered in the source pools."""
    block_bytes = (32 << 20) // blocks
    layout = BlockLayout(num_blocks=POOL_BLOCKS, block_bytes=block_bytes, num_layers=4, kv=2, num_kv_heads=4,
                         tokens_per_block=16, head_dim=block_bytes // (4 * 2 * 4 * 16 * 2), dtype_bytes=2,
                         order="HND")
    infos = [RankInfo(r, f"src-tp{r}", None, (1 << 40) * (r + 1), POOL_BLOCKS * block_bytes, layout)
             for r in range(2)]
    rng = random.Random(blocks)
    src = [RankBlocks(r, rng.sample(range(POOL_BLOCKS), blocks)) for r in range(2)]
    planner = ReadPlanner(source_tp=2, source_ranks=infos, target_layout=layout, target_base=1 << 44,
                          target_tp=2, target_rank=1)
    return planner, src, list(range(blocks))


def _use_path(path: str) -> None:
    """``compiled``: the planner's own choice; ``array``: numpy for every request."""
    tp_mapping.COMPILED_WHOLE_BLOCK_PLANS = path == "compiled"


def _pin(cpu: int | None) -> None:
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})


def _worker(sock: socket.socket, blocks: int, cpu: int | None, path: str) -> None:
    """Answer each message: ``w`` → plan once and send how long it took; ``p`` → answer at once."""
    _pin(cpu)
    _use_path(path)
    planner, src, dst = _planner_and_request(blocks)
    planner.plan(src, dst)
    while True:
        msg = sock.recv(1)
        if msg in (b"", b"q"):
            return
        if msg == b"p":
            sock.sendall(_TIME.pack(0.0, 0.0))
            continue
        t0 = time.perf_counter()
        planner.plan(src, dst)
        t1 = time.perf_counter()
        planner.plan(src, dst)  # the same call again: is the slowness the first touch after the wake-up?
        sock.sendall(_TIME.pack(t1 - t0, time.perf_counter() - t1))


def _recv_times(sock: socket.socket) -> tuple[float, float]:
    buf = sock.recv(_TIME.size, socket.MSG_WAITALL)  # the whole answer, or less only when the worker is gone
    if len(buf) < _TIME.size:
        raise RuntimeError("the worker process went away")
    return _TIME.unpack(buf)


def _warm_us(blocks: int, reps: int, path: str) -> float:
    _use_path(path)
    planner, src, dst = _planner_and_request(blocks)
    planner.plan(src, dst)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        planner.plan(src, dst)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(blocks: int, rounds: int, idle_ms: list[float], cpus: tuple[int | None, int | None],
            path: str = "compiled") -> dict:
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    parent.settimeout(IO_TIMEOUT_S)
    proc = mp.get_context("fork").Process(target=_worker, args=(child, blocks, cpus[1], path), daemon=True)
    proc.start()
    child.close()
    _pin(cpus[0])
    out: dict = {"blocks": blocks, "path": path, "plan_warm_us": _warm_us(blocks, rounds, path), "idle": {}}
    try:
        for gap in idle_ms:
            rtt, woken, again = [], [], []
            for _ in range(rounds):  # interleaved, so a noisy second hits both kinds alike
                if gap:
                    time.sleep(gap / 1000.0)
                t0 = time.perf_counter()
                parent.sendall(b"p")
                _recv_times(parent)
                rtt.append(time.perf_counter() - t0)
                if gap:
                    time.sleep(gap / 1000.0)
                parent.sendall(b"w")
                first, second = _recv_times(parent)
                woken.append(first)
                again.append(second)
            out["idle"][str(gap)] = {"round_trip_us": statistics.median(rtt) * 1e6,
                                     "round_trip_p90_us": pct(rtt, 90) * 1e6,
                                     "plan_woken_us": statistics.median(woken) * 1e6,
                                     "plan_woken_p90_us": pct(woken, 90) * 1e6,
                                     "plan_again_us": statistics.median(again) * 1e6}
    finally:
        parent.sendall(b"q")
        proc.join(5)
        if proc.is_alive():
            proc.kill()
        parent.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=300)
    ap.add_argument("--blocks", default="32,512", help="blocks per rank (32: 1 MiB blocks, 512: 64 KiB)")
    ap.add_argument("--idle-ms", default="0,20", help="idle gaps before each message, ms (0: back to back)")
    ap.add_argument("--cpus", choices=["any", "same", "split"], default="any",
                    help="both processes on CPU 0 (same), on CPUs 0 and 1 (split), or wherever (any)")
    ap.add_argument("--plan-path", choices=["compiled", "array", "both"], default="compiled",
                    help="the planner's own choice (compiled), numpy always (array), or both side by side")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not 1 <= args.rounds <= 100_000:
        ap.error("--rounds must be 1..100000")
    blocks = [int(b) for b in args.blocks.split(",")]
    if any(not 1 <= b <= POOL_BLOCKS for b in blocks):
        ap.error(f"--blocks must be 1..{POOL_BLOCKS}")
    gaps = [float(g) for g in args.idle_ms.split(",")]
    if any(not 0 <= g <= 1000 for g in gaps):
        ap.error("--idle-ms must be 0..1000")
    cpus = {"any": (None, None), "same": (0, 0), "split": (0, 1)}[args.cpus]
    paths = ["compiled", "array"] if args.plan_path == "both" else [args.plan_path]
    rows = [measure(b, args.rounds, gaps, cpus, path) for b in blocks for path in paths]
    print(f"one hop on this machine: {os.cpu_count()} CPUs, {platform.machine()}, processes on CPUs: {args.cpus}; "
          f"median of {args.rounds} (p90)")
    print(f"{'blocks':>6} {'path':>8} {'idle ms':>7} {'round trip us':>15} {'plan warm us':>13} {'plan woken us':>15} "
          f"{'woken/warm':>10} {'again us':>8}")
    for r in rows:
        for gap, g in r["idle"].items():
            print(f"{r['blocks']:>6} {r['path']:>8} {float(gap):>7g} {g['round_trip_us']:>7.0f} ({g['round_trip_p90_us']:>4.0f}) "
                  f"{r['plan_warm_us']:>13.0f} {g['plan_woken_us']:>7.0f} ({g['plan_woken_p90_us']:>4.0f}) "
                  f"{g['plan_woken_us'] / r['plan_warm_us']:>10.1f} {g['plan_again_us']:>8.0f}")
    print("  round trip: two wake-ups, no work; plan: one target rank's ReadPlanner.plan for a 64 MiB TP 2->2 "
          "fetch, warm in a loop vs right after a message woke the process\n  (path compiled: the planner's choice, "
          "one call into the _read_plan extension; array: numpy always);\n  again: the same call once more, "
          "right after the woken one")
    if args.json:
        write_result(args.json, "wake_cost", args=vars(args), cpus=args.cpus, rounds=args.rounds,
                     machine=platform.platform(), rows=rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
